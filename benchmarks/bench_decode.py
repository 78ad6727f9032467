"""Decode throughput, cache bytes per request, and time-to-first-token on a prefix-cache hit (SPEC §7):
the hybrid model (3 KDA : 1 MLA) against the same model with every layer MLA, in one run.

    python benchmarks/bench_decode.py [--preset small] [--contexts 8192,32768,131072] [--batch 8]
                                      [--prefix 65536] [--json out.json]

Decode: ``batch`` requests with ``context`` prompt tokens each are prefilled, then decode steps are timed
(tokens/s = batch / step time). Cache bytes per request are read from the pool's layout. TTFT: a request whose
first ``prefix`` tokens another request already computed (hit) against one with a fresh prefix (miss).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import header  # noqa: E402
from k3 import K3Config, K3ForCausalLM  # noqa: E402
from k3.data.tokenizer import train_tokenizer  # noqa: E402
from k3.inference.api import GenerationRequest, SamplingParams  # noqa: E402
from k3.inference.engine import Engine, EngineConfig  # noqa: E402


def sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize()


def build(cfg, device, dtype, pages, page_tokens, tok):
    torch.manual_seed(0)
    model = K3ForCausalLM(cfg.replace(vocab_size=tok.get_vocab_size(), num_nextn_predict_layers=0)).to(device, dtype)
    return Engine(model, tok, EngineConfig(num_pages=pages, page_tokens=page_tokens, hash_block=512,
                                           checkpoint_every=4, prefill_chunk=8192, max_context=1 << 21))


def decode_rate(engine, context, batch, steps):
    g = torch.Generator().manual_seed(context)
    V = engine.model.config.vocab_size
    hs = [engine.submit(GenerationRequest(tuple(torch.randint(1, V, (context,), generator=g).tolist()),
                                          SamplingParams(max_tokens=steps + 2, temperature=0))) for _ in range(batch)]
    while any(s.in_prefill for s in engine.running) or engine.waiting:
        engine.step()
    engine.step()  # first decode step (warm-up)
    sync(engine.device)
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    sync(engine.device)
    dt = (time.perf_counter() - t0) / steps
    for h in hs:
        h.cancel()
    engine.step()
    return batch / dt


def ttft(engine, prefix_ids, suffix):
    t0 = time.perf_counter()
    h = engine.submit(GenerationRequest(tuple(prefix_ids + suffix), SamplingParams(max_tokens=1, temperature=0)))
    while engine.has_work:
        engine.step()
    sync(engine.device)
    return time.perf_counter() - t0, list(h)[-1].cached_tokens


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="small")
    ap.add_argument("--contexts", default="8192,32768,131072")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--prefix", type=int, default=65536)
    ap.add_argument("--pages", type=int, default=4096)
    ap.add_argument("--page-tokens", type=int, default=1024)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    dev = torch.device(args.device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    tok = train_tokenizer(["k3 benchmark text " * 50], 300)
    base = K3Config.preset(args.preset)
    rows = []
    for name, cfg in (("hybrid", base), ("all-MLA", base.variant(layers="all-mla"))):
        eng = build(cfg, dev, dtype, args.pages, args.page_tokens, tok)
        L = eng.layout
        for ctx in map(int, args.contexts.split(",")):
            rate = decode_rate(eng, ctx, args.batch, args.steps)
            cache_bytes = L.kda_state_bytes + ctx * L.mla_bytes_per_token
            rows.append({"model": name, "context": ctx, "decode_tokens_per_s": rate, "cache_bytes_per_request": cache_bytes})
            print(json.dumps(rows[-1]), flush=True)
        g = torch.Generator().manual_seed(1)
        prefix = torch.randint(1, tok.get_vocab_size(), (args.prefix,), generator=g).tolist()
        miss, _ = ttft(eng, prefix, [5, 6, 7])
        hit, cached = ttft(eng, prefix, [8, 9, 10])
        rows.append({"model": name, "ttft_miss_s": miss, "ttft_hit_s": hit, "cached_tokens": cached})
        print(json.dumps(rows[-1]), flush=True)
        del eng
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    out = {**header(), "preset": args.preset, "batch": args.batch, "rows": rows}
    print("\n| model | context | decode tokens/s | cache per request |\n|---|---|---|---|")
    for r in rows:
        if "context" in r:
            print(f"| {r['model']} | {r['context']:,} | {r['decode_tokens_per_s']:,.0f} | "
                  f"{r['cache_bytes_per_request'] / 2**20:,.1f} MiB |")
    for r in rows:
        if "ttft_miss_s" in r:
            print(f"{r['model']}: TTFT {args.prefix:,}-token prefix miss {r['ttft_miss_s']:.2f} s, hit "
                  f"{r['ttft_hit_s']:.3f} s ({r['cached_tokens']:,} cached), {r['ttft_miss_s'] / r['ttft_hit_s']:.0f}x")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
