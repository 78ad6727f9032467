"""k3 generate: sample a continuation from a checkpoint through the inference engine."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

HELP = "sample a continuation of --prompt from a checkpoint (streams to stdout)"


def add_arguments(p) -> None:
    p.add_argument("--checkpoint", required=True, help="a checkpoint directory (e.g. RUN/checkpoint) or a run directory")
    p.add_argument("--prompt", required=True)
    add_sampling_arguments(p)
    p.add_argument("--device", default="auto")


def add_sampling_arguments(p, max_tokens: int = 64) -> None:
    p.add_argument("--max-tokens", type=int, default=max_tokens)
    p.add_argument("--temperature", type=float, default=0.8, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=50, help="0 = off")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)


def sampling_from_args(args, stop=()):
    from ..inference.api import SamplingParams

    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
                          top_p=args.top_p, seed=args.seed, stop=tuple(stop))


def inference_dtype(device, name: str = "auto") -> torch.dtype:
    """bf16 on CUDA (the fused expert matmul and CUDA graphs need it), fp32 on the CPU, unless named."""
    if name == "auto":
        return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    return {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[name]


def load_for_inference(path: str | Path, device, dtype: torch.dtype | None = None):
    """(model, tokenizer) from a checkpoint directory or a run directory holding ``checkpoint/``; the model in
    ``dtype`` (default: ``inference_dtype(device)``)."""
    from ..checkpoint import load_pretrained
    from ..data import load_tokenizer

    p = Path(path)
    if (p / "checkpoint").is_dir():
        p = p / "checkpoint"
    if not (p / "tokenizer.json").exists():
        raise FileNotFoundError(f"no tokenizer.json in {p}: point --checkpoint at a k3 checkpoint directory")
    model = load_pretrained(p, dtype=torch.float32).to(device, dtype or inference_dtype(device)).eval()
    return model, load_tokenizer(p / "tokenizer.json")


def make_engine(model, tok, name: str = "k3", **overrides):
    from ..inference.engine import Engine, EngineConfig

    return Engine(model, tok, EngineConfig(**overrides), model_name=name)


def stream_completion(engine, prompt: str, params, out=sys.stdout) -> str:
    """Submit, print the text as it is generated, return it."""
    from ..data import encode
    from ..inference.api import GenerationRequest, TokenEvent

    ids = encode(engine.tokenizer, prompt)
    if not ids:
        raise ValueError("the prompt encodes to no tokens; give some text")
    handle = engine.submit(GenerationRequest(tuple(ids), params))
    text = ""
    for ev in handle:
        if isinstance(ev, TokenEvent):
            text += ev.text
            out.write(ev.text)
            out.flush()
    return text


def generate_text(model, tok, prompt: str, max_tokens: int, temperature: float = 0.8, top_k: int = 50,
                  seed: int = 0) -> str:
    """One completion, synchronously (no engine thread)."""
    from ..data import encode
    from ..inference.api import SamplingParams

    engine = make_engine(model, tok)
    params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_k=top_k, seed=seed)
    return engine.generate([encode(tok, prompt)], params)[0].text


def run(args) -> int:
    from ..train.loop import resolve_device

    model, tok = load_for_inference(args.checkpoint, resolve_device(args.device))
    engine = make_engine(model, tok, Path(args.checkpoint).name)
    engine.start()
    try:
        sys.stdout.write(args.prompt)
        stream_completion(engine, args.prompt, sampling_from_args(args))
        sys.stdout.write("\n")
    finally:
        engine.stop()
    return 0
