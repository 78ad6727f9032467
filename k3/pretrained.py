"""The one place that turns a checkpoint directory into a model, and a model into one.

``k3.checkpoint`` reads and writes state dicts (names, shards, checksums) and builds nothing; this module sits
above the model, the vision tower and quantisation (tests/test_layers.py) and picks what to build:
``K3ForCausalLM``, or ``k3.vision.K3ForConditionalGeneration`` for a multimodal checkpoint read with its tower, with
the routed experts kept MXFP4-packed (``k3.quant.PackedExpertBank``) when asked. Training, inference and
post-training load through it; nothing below it does.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import torch

from .checkpoint import CheckpointError, mismatch_message, read_checkpoint, write_checkpoint
from .checkpoint.multimodal import TEXT_PREFIX
from .config import K3Config
from .model.transformer import K3ForCausalLM
from .quant import is_packed_state, pack_expert_state, pack_experts, quantization_config
from .vision.model import K3ForConditionalGeneration

__all__ = ["load_pretrained", "save_pretrained"]


def save_pretrained(model, directory: str | Path, max_shard_bytes: int = 5 * 2**30, state: dict | None = None,
                    quantization: str | None = None) -> None:
    """Write ``model`` (a K3ForCausalLM or K3ForConditionalGeneration) as config.json + safetensors in the
    checkpoint layout of ``config.hf_layout`` (k3.checkpoint.write_checkpoint: shards, index, SHA256SUMS).
    ``state``: the full state dict to write instead of ``model.state_dict()`` (e.g. gathered from FSDP shards).
    ``quantization="mxfp4"``: routed experts in the release's packed layout (k3.quant.export) with its
    ``quantization_config``; a model that already keeps its experts packed is written packed either way."""
    if quantization not in (None, "mxfp4"):
        raise ValueError(f"save_pretrained(quantization=...) must be None or 'mxfp4'; got {quantization!r}")
    state = {k: v.detach().cpu() for k, v in (model.state_dict() if state is None else state).items()}
    if quantization == "mxfp4":
        state = pack_expert_state(state)
    write_checkpoint(directory, state, model.config, max_shard_bytes,
                     quantization_config() if is_packed_state(state) else None)


def load_pretrained(directory: str | Path, config: K3Config | None = None, dtype=None, device="cpu",
                    strict: bool = True, verify: bool = True, keep_packed: bool = False, vision: bool | None = False):
    """Build the model a checkpoint directory holds: k3's, the K3 release, or a Kimi Linear checkpoint written by
    transformers. ``vision``: False builds the K3ForCausalLM (tensors it does not use, such as a vision tower, are
    skipped with a warning and listed in ``model.skipped_weights``); True a K3ForConditionalGeneration (the
    config.json must have a ``vision_config``); None whichever the config.json describes. ``verify``: check the
    files read against the directory's SHA256SUMS (when it has one). ``keep_packed``: serve the routed experts
    packed (MXFP4, k3.quant.PackedExpertBank); float experts in the checkpoint are quantised on load (post-training
    quantisation). ``strict``: refuse a checkpoint whose tensor names differ from the model's."""
    ckpt = read_checkpoint(directory, config, dtype, verify, keep_packed, vision)
    config, state, skipped = ckpt.config, ckpt.state, ckpt.skipped
    if keep_packed:
        state = pack_expert_state(state)
    prefix = TEXT_PREFIX if ckpt.vision else ""
    with torch.device("meta"):
        model = K3ForConditionalGeneration(config) if ckpt.vision else K3ForCausalLM(config)
    if keep_packed:
        pack_experts(model, quantize=False)
    expected = model.state_dict()
    if config.tie_word_embeddings:
        expected.pop(prefix + "lm_head.weight", None)
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if strict and (missing or unexpected):
        raise CheckpointError(mismatch_message(config, missing, unexpected))
    bad = [f"{k}: checkpoint {tuple(state[k].shape)} vs model {tuple(expected[k].shape)}"
           for k in expected if k in state and state[k].shape != expected[k].shape]
    if bad:
        raise CheckpointError("shape mismatch (a checkpoint of another config?): " + "; ".join(bad[:10]))
    model.load_state_dict({k: v.to(device) for k, v in state.items()}, strict=False, assign=True)
    lm = model.language_model if ckpt.vision else model
    if config.tie_word_embeddings:
        lm.lm_head.weight = lm.model.embed_tokens.weight
    leftover = [n for n, p in list(model.named_parameters()) + list(model.named_buffers()) if p.is_meta]
    if leftover:
        raise CheckpointError(f"parameters not in the checkpoint: {leftover[:10]}")
    unused = [n for n in skipped if ".shared_head.head." not in n]  # MTP heads repeat lm_head: nothing to say
    if unused:
        prefixes = sorted({n.removeprefix("language_model.").split(".")[0] for n in unused})
        warnings.warn(f"{directory}: loaded the text model; skipped {len(unused)} tensor(s) it does not use "
                      f"(under {', '.join(prefixes)}); see model.skipped_weights", stacklevel=2)
    model.skipped_weights = skipped
    return model
