"""Loading a checkpoint for inference: the model in its serving dtype, evaluation mode, and its tokenizer.

``k3 generate``, ``k3 chat``, ``k3 serve``, ``k3 eval`` and the lm-evaluation-harness model all start here.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..pretrained import load_pretrained
from ..checkpoint.manifest import verify_checksums
from ..data import load_tokenizer
from ..data.kimi_tokenizer import is_kimi_tokenizer_dir

__all__ = ["inference_dtype", "load_for_inference"]


def inference_dtype(device, name: str = "auto") -> torch.dtype:
    """bf16 on CUDA (the fused expert matmul and CUDA graphs need it), fp32 on the CPU, unless named."""
    if name == "auto":
        return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    return {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[name]


def load_for_inference(path: str | Path, device, dtype: torch.dtype | None = None, verify: bool = True,
                       packed_experts: bool = False):
    """(model, tokenizer) from a checkpoint directory or a run directory holding ``checkpoint/``: the model in
    ``dtype`` (default: ``inference_dtype(device)``); ``verify`` checks the files against the checkpoint's
    SHA256SUMS (k3.checkpoint.manifest) first; ``packed_experts``: the routed experts stay MXFP4-packed
    (k3.quant.PackedExpertBank; the dtype cast leaves their uint8 buffers alone). A multimodal checkpoint (its
    config.json has a ``vision_config``) loads with its vision tower (k3.vision.K3ForConditionalGeneration). The
    tokenizer is the Kimi release's (``tiktoken.model`` + ``tokenizer_config.json``) when the directory has one,
    else k3's ``tokenizer.json``."""
    p = Path(path)
    if not p.is_dir():
        raise FileNotFoundError(f"--checkpoint {path}: no such directory; point it at a k3 checkpoint directory "
                                "(RUN/checkpoint) or a run directory")
    if (p / "checkpoint").is_dir():
        p = p / "checkpoint"
    kimi = is_kimi_tokenizer_dir(p)
    if not (p / "tokenizer.json").exists() and not kimi:
        raise FileNotFoundError(f"no tokenizer.json or tiktoken.model in {p}: point --checkpoint at a k3 checkpoint "
                                "directory or a Kimi release directory")
    if verify:
        verify_checksums(p, ["tiktoken.model", "tokenizer_config.json"] if kimi else ["tokenizer.json"])
    model = load_pretrained(p, dtype=torch.float32, verify=verify, keep_packed=packed_experts, vision=None)
    model = model.to(device, dtype or inference_dtype(device)).eval()
    return model, load_tokenizer(p)
