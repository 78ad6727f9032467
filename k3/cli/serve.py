"""k3 serve: an OpenAI-compatible HTTP server (/v1/models, /v1/completions, /v1/chat/completions)."""

from __future__ import annotations

from pathlib import Path

import torch

from ..config import PRESETS
from .generate import add_packed_argument

HELP = "serve a checkpoint over an OpenAI-compatible HTTP API (localhost by default)"


def add_arguments(p) -> None:
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--checkpoint", help="a checkpoint directory (or a run directory holding checkpoint/)")
    src.add_argument("--preset", choices=list(PRESETS), help="with --random-init: a randomly initialised model")
    p.add_argument("--random-init", action="store_true", help="smoke tests: random weights and a small BPE")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default: localhost only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--model-name", default=None, help="the name clients pass as `model` (default: the directory)")
    p.add_argument("--num-pages", type=int, default=512, help="cache pages in the block pool")
    p.add_argument("--page-tokens", type=int, default=1024)
    p.add_argument("--hash-block", type=int, default=512, help="prefix-hash block (tokens); divides --page-tokens")
    p.add_argument("--checkpoint-every", type=int, default=4, help="KDA state checkpoint every N hash blocks")
    p.add_argument("--max-batch", type=int, default=64)
    p.add_argument("--device", default="auto")
    add_packed_argument(p)


def _random_model(preset: str, device):
    from ..data import stdlib_documents, train_tokenizer
    from ..model.transformer import K3ForCausalLM

    cfg = PRESETS[preset]()
    tok = train_tokenizer(stdlib_documents(max_bytes=500_000), min(cfg.vocab_size, 4096))
    torch.manual_seed(0)
    return K3ForCausalLM(cfg.replace(vocab_size=tok.get_vocab_size())).to(device).eval(), tok


def run(args) -> int:
    from ..inference.engine import Engine, EngineConfig
    from ..model.params import memory_summary
    from ..quant import pack_experts
    from ..serve import run_server
    from ..train.loop import resolve_device
    from .generate import load_for_inference

    device = resolve_device(args.device)
    if args.checkpoint:
        model, tok = load_for_inference(args.checkpoint, device, args.packed_experts)
        name = args.model_name or Path(args.checkpoint).resolve().name
    else:
        if not args.random_init:
            raise ValueError("--preset serves random weights only with --random-init (use --checkpoint for a trained model)")
        model, tok = _random_model(args.preset, device)
        if args.packed_experts:
            pack_experts(model)
        name = args.model_name or args.preset
    print(f"k3 serve: {memory_summary(model)}", flush=True)
    engine = Engine(model, tok, EngineConfig(num_pages=args.num_pages, page_tokens=args.page_tokens,
                                             hash_block=min(args.hash_block, args.page_tokens),
                                             checkpoint_every=args.checkpoint_every, max_batch=args.max_batch),
                    model_name=name)
    run_server(engine, host=args.host, port=args.port)
    return 0
