"""k3 serve: an OpenAI-compatible HTTP server (/v1/models, /v1/completions, /v1/chat/completions)."""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import torch

from ..config import PRESETS
from .common import add_verify_argument, int_at_least, int_in, number
from .generate import add_packed_argument

HELP = "serve a checkpoint over an OpenAI-compatible HTTP API (localhost by default)"

POOL_HELP = """The page pool holds every request's cache: MLA latents (page-tokens tokens per page) and KDA states
(whole pages per request, fixed size). By default it takes --memory-fraction of the GPU memory left after the
model (on the CPU: 512 pages). The longest request the pool can hold is reported on /health (max_context) and
/v1/models (max_model_len); more pages raise it and let more requests run at once."""


def add_arguments(p) -> None:
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--checkpoint", help="a checkpoint directory (or a run directory holding checkpoint/)")
    src.add_argument("--preset", choices=list(PRESETS), help="with --random-init: a randomly initialised model")
    p.add_argument("--random-init", action="store_true", help="smoke tests: random weights and a small BPE")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default: localhost only)")
    p.add_argument("--port", type=int_in(1, 65535), default=8000, help="TCP port")
    p.add_argument("--model-name", default=None, help="the name clients pass as `model` (default: the directory)")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"],
                   help="model dtype (auto: bfloat16 on CUDA, float32 on the CPU)")
    g = p.add_argument_group("page pool", POOL_HELP)
    g.add_argument("--num-pages", type=int_at_least(2), default=None,
                   help="device pages, one of them scratch (default: from --memory-fraction)")
    g.add_argument("--memory-fraction", type=number(0, 1, lo_open=True), default=0.8,
                   help="of the free GPU memory after loading the model, for the pool (default 0.8)")
    g.add_argument("--page-tokens", type=int_at_least(1), default=1024,
                   help="MLA tokens per page (a multiple of --hash-block)")
    g.add_argument("--hash-block", type=int_at_least(1), default=512,
                   help="prefix-cache granularity in tokens: a shared prefix is reused at any multiple of it")
    g.add_argument("--checkpoint-every", type=int_at_least(1), default=4,
                   help="a KDA state checkpoint every N hash blocks (and at each prompt's last full block)")
    g.add_argument("--host-pages", type=int_at_least(0), default=0,
                   help="the prefix cache's write-back tier: pages of CPU memory for evicted prefixes (default 0)")
    s = p.add_argument_group("scheduling")
    s.add_argument("--max-batch", type=int_at_least(1), default=64, help="most requests running at once")
    s.add_argument("--step-tokens", type=int_at_least(1), default=4096,
                   help="most tokens per engine step (decodes + prefill)")
    s.add_argument("--prefill-chunk", type=int_at_least(1), default=2048,
                   help="most prompt tokens of one request per step")
    s.add_argument("--long-prompt", type=int_at_least(1), default=32768,
                   help="prompts this long are the long class: they get at most half the prefill budget and the "
                        "pool while short requests wait")
    s.add_argument("--step-target", type=number(0, lo_open=True), default=0.25, metavar="SECONDS",
                   help="while requests decode, prompt chunks shrink so a step takes about this long (the engine "
                        "times its steps): a long prompt delays each streamed token by one such step")
    s.add_argument("--no-cuda-graphs", action="store_true", help="decode eagerly on CUDA (no graphs, no compile)")
    s.add_argument("--no-async-scheduling", action="store_true",
                   help="read each step's results before planning the next (default on CUDA: plan while it runs)")
    s.add_argument("--in-process", action="store_true",
                   help="run the engine on a thread of the HTTP server's process (default: in a process of its own, "
                        "so the server's event loop and the engine's steps never wait for each other's interpreter "
                        "lock)")
    add_verify_argument(p)
    add_packed_argument(p)


def _random_tokenizer(preset: str):
    """The small BPE of a --random-init server (deterministic: both of its processes build the same one)."""
    from ..data import stdlib_documents, train_tokenizer

    return train_tokenizer(stdlib_documents(max_bytes=500_000), min(PRESETS[preset]().vocab_size, 4096))


def serve_tokenizer(args):
    """The tokenizer of the model ``build_engine(args)`` serves, without the model (for the server's process)."""
    from ..data import load_tokenizer

    if args.checkpoint:
        p = Path(args.checkpoint)
        return load_tokenizer(p / "checkpoint" if (p / "checkpoint").is_dir() else p)
    return _random_tokenizer(args.preset)


def _random_model(preset: str, device, dtype):
    from ..model.transformer import K3ForCausalLM

    cfg = PRESETS[preset]()
    tok = _random_tokenizer(preset)
    torch.manual_seed(0)
    return K3ForCausalLM(cfg.replace(vocab_size=tok.get_vocab_size())).to(device, dtype).eval(), tok


def pool_pages(model, page_tokens: int, device, fraction: float, dtype) -> int:
    """How many pages --memory-fraction of the free device memory holds (512 on the CPU)."""
    from ..inference.pool import PageLayout

    if torch.device(device).type != "cuda":
        return 512
    free, _ = torch.cuda.mem_get_info(device)
    page = PageLayout.from_config(model.config, page_tokens, dtype).page_bytes
    return max(2, int(free * fraction) // page)


def build_engine(args):
    """The engine ``k3 serve`` runs for ``args`` (a picklable namespace: the engine's own process builds it too)."""
    from ..inference.engine import Engine, EngineConfig
    from ..inference.load import inference_dtype, load_for_inference
    from ..quant import pack_experts
    from ..train.loop import resolve_device

    device = resolve_device(args.device)
    dtype = inference_dtype(device, args.dtype)
    if args.checkpoint:
        model, tok = load_for_inference(args.checkpoint, device, dtype, verify=args.verify,
                                        packed_experts=args.packed_experts)
        name = args.model_name or Path(args.checkpoint).resolve().name
    else:
        if not args.random_init:
            raise ValueError("--preset serves random weights only with --random-init "
                             "(use --checkpoint for a trained model)")
        model, tok = _random_model(args.preset, device, dtype)
        if args.packed_experts:
            pack_experts(model)
        name = args.model_name or args.preset
    pages = args.num_pages or pool_pages(model, args.page_tokens, device, args.memory_fraction, dtype)
    graphs = False if args.no_cuda_graphs else None
    return Engine(model, tok, EngineConfig(
        num_pages=pages, page_tokens=args.page_tokens, hash_block=min(args.hash_block, args.page_tokens),
        checkpoint_every=args.checkpoint_every, host_pages=args.host_pages, max_batch=args.max_batch,
        step_tokens=args.step_tokens, prefill_chunk=args.prefill_chunk, long_prompt=args.long_prompt,
        decode_step_target_s=args.step_target, cuda_graphs=graphs, compile=graphs, async_scheduling=False if args.no_async_scheduling else None),
        model_name=name)


def describe(engine) -> str:
    from ..model.params import memory_summary

    return (f"{engine.model_name} on {engine.device} ({next(engine.model.parameters()).dtype}), "
            f"{memory_summary(engine.model)}; page pool {engine.pool.usable + 1} pages x "
            f"{engine.layout.page_bytes / 2**20:.1f} MiB, longest request {engine.max_context:,} tokens; CUDA graphs "
            f"{'on' if engine.runner.use_graphs else 'off'}, asynchronous scheduling "
            f"{'on' if engine.async_scheduling else 'off'}")


def build_and_describe(args):
    """``build_engine`` in the engine's process, saying what it built (one line on stderr)."""
    engine = build_engine(args)
    print(f"k3 serve: {describe(engine)}", file=sys.stderr, flush=True)
    return engine


def bind(host: str, port: int):
    """The listening socket, bound before the model loads: a taken port is refused at once."""
    import socket

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise OSError(f"--host {host} --port {port}: cannot listen there ({e.strerror}); another server may hold "
                      "the port: stop it or choose another --port") from None
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def run(args) -> int:
    from ..serve import run_server
    from ..serve.backend import LocalBackend
    from ..serve.core import EngineProcess

    if args.preset and not args.random_init:
        raise ValueError("--preset serves random weights only with --random-init (use --checkpoint for a trained "
                         "model)")
    sock = bind(args.host, args.port)
    if args.in_process:
        backend = LocalBackend(build_and_describe(args), warmup=True)
    else:
        backend = EngineProcess(functools.partial(build_and_describe, args), serve_tokenizer(args))
    run_server(backend, host=args.host, port=args.port, sock=sock)
    return 0
