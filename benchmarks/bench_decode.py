"""Decode throughput of the engine, cache bytes, and time-to-first-token on a prefix hit (SPEC §7), against a plain
PyTorch dense model of the same width under CUDA graphs, in one run.

    python benchmarks/bench_decode.py [--preset small] [--batches 1,8,32,64] [--context 2048]
        [--long-contexts 8192,32768,131072] [--long-batch 8] [--prefix 65536] [--steps 40]
        [--sections k3,mla,budget,peer,ttft,eager,sync,nocompile] [--profile] [--json out.json]

k3: ``batch`` requests of ``context`` random prompt tokens are prefilled through the engine, then ``steps`` engine
steps are timed (tokens/s = batch / step time; the step is the engine's whole step: scheduling, input copies,
graph replays, sampling, detokenisation). Rows: the hybrid model (3 KDA : 1 MLA) at every batch and long
context; the same model with every layer MLA at the long contexts; "budget": the hybrid at the longest context with
as many requests as fit in the cache bytes of the all-MLA model's ``--long-batch`` (a fixed cache-memory budget, as a
server has); the hybrid decoding eagerly (no graphs) at
batch 1; the hybrid with synchronous scheduling (each step's results read before the next is planned) at the
smallest and largest batch, beside the default asynchronous one; ``nocompile`` (not in the default sections): CUDA
graphs of the eager, uncompiled step at the smallest and largest batch (what RL rollouts run). Peer: a 12-layer dense transformer of the same
width (hidden, heads, SwiGLU MLP, RMSNorm, vocabulary), its KV cache as static buffers, ``torch.compile``d and
captured as a CUDA graph per batch (gpt-fast's recipe).
Bytes/s: the weights a step must read (every non-expert weight, the LM head, and the experts the batch can
reach: min(E, B*k) of E per layer) plus the cache it reads (MLA latents) and reads + writes (KDA states), over
the step time, against the H200's ~4.3 TB/s.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import header, host_counters, slowest  # noqa: E402
from k3 import K3Config, K3ForCausalLM  # noqa: E402
from k3.data.tokenizer import train_tokenizer  # noqa: E402
from k3.inference.api import GenerationRequest, SamplingParams  # noqa: E402
from k3.inference.engine import Engine, EngineConfig  # noqa: E402
from k3.inference.pool import PageLayout  # noqa: E402

HBM = 4.3e12  # bytes/s, the H200's measured device-to-device copy rate


def sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize()


# ---- k3 -------------------------------------------------------------------------------------------------------
def build_engine(cfg, device, dtype, tok, tokens_needed: int, max_batch: int, graphs: bool | None = None,
                 async_scheduling: bool | None = None, compile: bool | None = None, checkpoint_every: int = 4):
    torch.manual_seed(0)
    model = K3ForCausalLM(cfg.replace(vocab_size=cfg.vocab_size, num_nextn_predict_layers=0)).to(device, dtype).eval()
    kda_pages = PageLayout.from_config(model.config, 1024, dtype).kda_pages
    pages = math.ceil(tokens_needed / 1024) + max_batch * (kda_pages + 2) + 64
    return Engine(model, tok, EngineConfig(num_pages=pages, page_tokens=1024, hash_block=512,
                                           checkpoint_every=checkpoint_every,
                                           prefill_chunk=8192, step_tokens=16384, max_batch=max_batch,
                                           max_context=1 << 21, cuda_graphs=graphs,
                                           compile=graphs if compile is None else compile,
                                           async_scheduling=async_scheduling))


def decode_rate(engine, context: int, batch: int, steps: int, profile: bool = False):
    g = torch.Generator().manual_seed(context + batch)
    V = engine.model.config.vocab_size
    # room for the tokens the first-admitted requests decode while later ones still prefill: every request must be
    # running through the whole timed window (checked below), or the window would count rows that are gone
    params = SamplingParams(max_tokens=steps + 4096, temperature=0, ignore_eos=True)
    hs = [engine.submit(GenerationRequest(tuple(torch.randint(1, V, (context,), generator=g).tolist()), params))
          for _ in range(batch)]
    while engine.waiting or any(s.pending > 1 for s in engine.running):
        engine.step()
    for _ in range(3):  # warm-up: graph capture of this bucket, first replays
        engine.step()
    sync(engine.device)
    alloc0 = host_counters(engine.device)  # the allocator's counts are read around the window, not per step
    events = [host_events(engine)]
    t0 = time.perf_counter()
    marks = []
    for _ in range(steps):
        engine.step()
        marks.append(time.perf_counter())
        events.append(host_events(engine))
    sync(engine.device)
    dt = (time.perf_counter() - t0) / steps
    if len(engine.running) != batch:
        raise RuntimeError(f"{len(engine.running)} of the {batch} requests were still running after the timed steps: "
                           "the rate would count rows that had finished (raise max_tokens)")
    # host time between step returns (asynchronous scheduling: a step returns once its successor is launched), to
    # tell a uniformly slow step from a few slow ones; for the slowest, what happened during it
    each = [b - a for a, b in zip([t0] + marks[:-1], marks)]
    s_each = sorted(each)
    spread = {"min": s_each[0] * 1e3, "median": s_each[len(s_each) // 2] * 1e3, "max": s_each[-1] * 1e3,
              **slowest(each, events),
              "allocator_during_window": {k: v - alloc0[k] for k, v in host_counters(engine.device).items()
                                          if k in ("alloc_retries", "segments") and v != alloc0[k]}}
    top = None
    if profile:
        top = profile_step(engine)
    for h in hs:
        h.cancel()
    while engine.has_work:
        engine.step()
    return batch / dt, dt, top, spread


def host_events(engine) -> dict:
    """``common.host_counters`` without the allocator (cheap enough between steps) and the engine's own: CUDA graphs
    captured, preemptions, host-tier pages."""
    r = engine.runner
    out = {**host_counters(engine.device, allocator=False), "preemptions": engine.scheduler.preemptions,
           "graphs": len(getattr(r, "_graphs", {})) + len(getattr(r, "_sample_graphs", {}))}
    if engine.prefix is not None and engine.prefix.host is not None:
        out["host_pages"] = engine.prefix.host.pages_in_use
    return out


def profile_step(engine, n: int = 3) -> dict:
    """torch.profiler over n engine steps: GPU kernel count and time per step, the top kernels, wall time."""
    from torch.profiler import ProfilerActivity, profile

    sync(engine.device)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        for _ in range(n):
            engine.step()
        sync(engine.device)
        wall = (time.perf_counter() - t0) / n
    events = [e for e in prof.key_averages() if e.device_type.name == "CUDA"]
    kernels = sum(e.count for e in events) / n
    gpu = sum(e.device_time_total for e in events) / n / 1e3
    events.sort(key=lambda e: -e.device_time_total)
    print(f"  profile: {kernels:.0f} GPU kernels per step, {gpu:.3f} ms GPU time, {wall * 1e3:.3f} ms wall", flush=True)
    every = [(e.key[:120], e.count / n, round(e.device_time_total / n / 1e3, 4)) for e in events]
    for k, c, ms in every[:12]:
        print(f"    {ms:8.4f} ms  x{c:<6.1f} {k[:70]}", flush=True)
    # every kernel of a step in the JSON: the inventory that says what to fuse next
    return {"kernels_per_step": kernels, "gpu_ms_per_step": gpu, "wall_ms_per_step": wall * 1e3, "top": every}


def explain_graph_breaks(engine) -> None:
    """torch._dynamo.explain of the decode forward at batch 2: how many graphs, and why it breaks."""
    r = engine.runner
    dev = engine.device
    args = (torch.zeros(2, dtype=torch.long, device=dev), torch.full((2,), -1, dtype=torch.long, device=dev),
            torch.zeros(2, dtype=torch.int32, device=dev),
            torch.full((2, 1), engine.pool.scratch, dtype=torch.int32, device=dev),
            torch.full((2, max(engine.layout.kda_pages, 1)), engine.pool.scratch, dtype=torch.long, device=dev))
    with torch.no_grad():
        ex = torch._dynamo.explain(r._decode_logits)(*args)
    print(f"  dynamo: {ex.graph_count} graph(s), {ex.graph_break_count} break(s)", flush=True)
    for b in ex.break_reasons[:5]:
        where = b.user_stack[-1] if b.user_stack else None
        print(f"    {b.reason.splitlines()[0][:120]} at {where.filename.split('/k3/')[-1]}:{where.lineno}"
              if where else f"    {b.reason[:120]}", flush=True)


def step_bytes(model, layout, batch: int, context: int) -> float:
    """Bytes one decode step must move: weights it reads + cache read (MLA) and read + written (KDA)."""
    c = model.config
    expert = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if ".experts." in n)
    dense = sum(p.numel() * p.element_size() for n, p in model.named_parameters()
                if ".experts." not in n and "embed_tokens" not in n)
    moe_layers = max(1, c.num_hidden_layers - c.first_k_dense_replace)
    reach = min(1.0, batch * c.num_experts_per_token / max(c.num_experts, 1)) if moe_layers else 0.0
    cache = batch * (context * layout.mla_bytes_per_token + 2 * layout.kda_state_bytes)
    return dense + expert * reach + cache


def _cache_bytes(cfg, dtype, context: int) -> int:
    """One request's cache bytes at ``context`` tokens: its MLA latents and its KDA states (conv tails included)."""
    layout = PageLayout.from_config(cfg, 1024, dtype)
    return layout.kda_state_bytes + context * layout.mla_bytes_per_token


# ---- the dense peer ---------------------------------------------------------------------------------------------
class DenseBlock(nn.Module):
    def __init__(self, dim, heads, inter, max_batch, max_seq, dtype):
        super().__init__()
        self.heads, self.hd = heads, dim // heads
        self.attn_norm, self.ffn_norm = nn.RMSNorm(dim), nn.RMSNorm(dim)
        self.wqkv, self.wo = nn.Linear(dim, 3 * dim, bias=False), nn.Linear(dim, dim, bias=False)
        self.w1, self.w3 = nn.Linear(dim, inter, bias=False), nn.Linear(dim, inter, bias=False)
        self.w2 = nn.Linear(inter, dim, bias=False)
        shape = (max_batch, heads, max_seq, dim // heads)
        self.register_buffer("k_cache", torch.zeros(shape, dtype=dtype), persistent=False)
        self.register_buffer("v_cache", torch.zeros(shape, dtype=dtype), persistent=False)

    def forward(self, x, pos, mask):  # x [B,1,D], pos [B], mask [B,1,1,S]
        B = x.shape[0]
        q, k, v = self.wqkv(self.attn_norm(x)).view(B, 1, 3, self.heads, self.hd).unbind(2)
        rows = torch.arange(B, device=x.device)
        self.k_cache[rows, :, pos] = k[:, 0]
        self.v_cache[rows, :, pos] = v[:, 0]
        o = F.scaled_dot_product_attention(q.transpose(1, 2), self.k_cache[:B], self.v_cache[:B], attn_mask=mask)
        x = x + self.wo(o.transpose(1, 2).reshape(B, 1, -1))
        h = self.ffn_norm(x)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))


class DensePeer(nn.Module):
    """A plain dense decoder of k3's width: what plain PyTorch does with the same hidden size."""

    def __init__(self, vocab, dim, layers, heads, inter, max_batch, max_seq, dtype):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(DenseBlock(dim, heads, inter, max_batch, max_seq, dtype) for _ in range(layers))
        self.norm, self.head = nn.RMSNorm(dim), nn.Linear(dim, vocab, bias=False)
        self.max_seq = max_seq

    def forward(self, ids, pos):  # ids [B], pos [B] -> logits [B,V]
        mask = (torch.arange(self.max_seq, device=ids.device)[None] <= pos[:, None])[:, None, None]
        x = self.embed(ids)[:, None]
        for layer in self.layers:
            x = layer(x, pos, mask)
        return self.head(self.norm(x))[:, 0].float()


def peer_rates(cfg, device, dtype, batches, context, steps):
    torch.manual_seed(0)
    peer = DensePeer(cfg.vocab_size, cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads,
                     cfg.intermediate_size, max(batches), context + steps + 16, dtype).to(device, dtype).eval()
    step = torch.compile(peer, dynamic=True)
    out = {}
    for B in batches:
        ids = torch.randint(1, cfg.vocab_size, (B,), device=device)
        pos = torch.full((B,), context, device=device)
        with torch.no_grad():
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                for _ in range(3):
                    step(ids, pos)
            torch.cuda.current_stream().wait_stream(s)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                logits = step(ids, pos)
            for _ in range(3):
                graph.replay()
            sync(device)
            t0 = time.perf_counter()
            for _ in range(steps):  # one token per step: replay, pick the next token, advance the position
                graph.replay()
                ids.copy_(logits.argmax(-1))
                pos.add_(1)
                ids.tolist()  # one host transfer per step, as a server needs
            sync(device)
        out[B] = B * steps / (time.perf_counter() - t0)
        print(json.dumps({"model": "dense peer", "batch": B, "context": context, "tokens_per_s": out[B]}), flush=True)
    weights = sum(p.numel() * p.element_size() for p in peer.parameters())
    return out, weights


# ---- TTFT ---------------------------------------------------------------------------------------------------
def ttft(engine, prompt):
    sync(engine.device)
    t0 = time.perf_counter()
    h = engine.submit(GenerationRequest(tuple(prompt), SamplingParams(max_tokens=1, temperature=0)))
    while engine.has_work:
        engine.step()
    sync(engine.device)
    return time.perf_counter() - t0, list(h)[-1].cached_tokens


def profile_ttft(engine, prompt, label: str) -> dict:
    """torch.profiler over one request's time to first token (a miss or a hit): GPU kernels and host ops."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        wall, cached = ttft(engine, prompt)
    avg = prof.key_averages()
    gpu = sorted((e for e in avg if e.device_type.name == "CUDA"), key=lambda e: -e.device_time_total)
    host = sorted((e for e in avg if e.device_type.name == "CPU"), key=lambda e: -e.self_cpu_time_total)
    out = {"wall_ms": wall * 1e3, "cached_tokens": cached,
           "gpu_ms": sum(e.device_time_total for e in gpu) / 1e3,
           "gpu_top": [(e.key[:120], e.count, round(e.device_time_total / 1e3, 3)) for e in gpu[:25]],
           "host_top": [(e.key[:120], e.count, round(e.self_cpu_time_total / 1e3, 3)) for e in host[:25]]}
    print(f"  profile of a {label}: {out['wall_ms']:.1f} ms wall, {out['gpu_ms']:.1f} ms of GPU kernels", flush=True)
    for k, c, ms in out["gpu_top"][:8]:
        print(f"    GPU  {ms:8.3f} ms  x{c:<5} {k[:70]}", flush=True)
    for k, c, ms in out["host_top"][:8]:
        print(f"    host {ms:8.3f} ms  x{c:<5} {k[:70]}", flush=True)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="small")
    ap.add_argument("--batches", default="1,8,32,64")
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--long-contexts", default="8192,32768,131072")
    ap.add_argument("--long-batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--prefix", type=int, default=65536)
    ap.add_argument("--sections", default="k3,mla,budget,peer,ttft,eager,sync")
    ap.add_argument("--profile", action="store_true", help="torch.profiler table of a step at the first and the last "
                    "of --batches")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    dev = torch.device(args.device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    sections = set(args.sections.split(","))
    batches = [int(b) for b in args.batches.split(",")]
    longs = [int(c) for c in args.long_contexts.split(",") if c]
    base = K3Config.preset(args.preset)
    tok = train_tokenizer(["k3 benchmark text " * 50], 300)
    rows, t_start = [], time.perf_counter()

    def record(row):
        row["elapsed_s"] = round(time.perf_counter() - t_start, 1)
        rows.append(row)
        print(json.dumps(row), flush=True)

    if "k3" in sections or "ttft" in sections:
        need = max(max(batches) * (args.context + args.steps + 16), (3 if args.profile else 2) * args.prefix + 4096)
        eng = build_engine(base, dev, dtype, tok, need, max(batches))
        if args.profile:
            explain_graph_breaks(eng)
        if "k3" in sections:
            for B in batches:
                rate, dt, top, spread = decode_rate(eng, args.context, B, args.steps,
                                                    args.profile and B in (batches[0], batches[-1]))
                gb = step_bytes(eng.model, eng.layout, B, args.context) / dt
                record({"model": "k3 hybrid", "batch": B, "context": args.context, "tokens_per_s": rate,
                        "step_ms": dt * 1e3, "step_spread_ms": spread, "bytes_per_s": gb, "of_hbm": gb / HBM,
                        "profile": top})
        if "ttft" in sections:
            g = torch.Generator().manual_seed(1)
            prefix = torch.randint(1, base.vocab_size, (args.prefix,), generator=g).tolist()
            warm = torch.randint(1, base.vocab_size, (4096,), generator=g).tolist()
            ttft(eng, warm)  # warm-up: the prefill kernels of a miss, then of a hit
            ttft(eng, warm + [1, 2, 3])
            miss, _ = ttft(eng, prefix + [5, 6, 7])
            hit, cached = ttft(eng, prefix + [8, 9, 10])
            profiles = None
            if args.profile:  # a fresh prefix: its miss, then its hit
                other = torch.randint(1, base.vocab_size, (args.prefix,), generator=g).tolist()
                profiles = {"miss": profile_ttft(eng, other + [5, 6, 7], "miss"),
                            "hit": profile_ttft(eng, other + [8, 9, 10], "hit")}
            record({"model": "k3 hybrid", "ttft_prefix": args.prefix, "ttft_miss_s": miss, "ttft_hit_s": hit,
                    "cached_tokens": cached, "speedup": miss / hit, "profiles": profiles})
        eng.stop()
        del eng
    # long contexts: the hybrid and the all-MLA model at --long-batch; "budget": the hybrid at the batch whose cache
    # bytes equal the all-MLA model's at --long-batch and the longest context (a fixed cache-memory budget). These
    # engines take a KDA checkpoint every 16 hash blocks (8K tokens) instead of 4, so prompts prefill in 8K chunks:
    # where checkpoints fall changes nothing in a decode step, and the prefill of ~4M prompt tokens takes a quarter
    # of the engine steps
    budget_batch = None
    if "budget" in sections and longs:
        C = max(longs)
        per_request = {name: _cache_bytes(base.variant(layers=name), dtype, C) for name in ("hybrid", "all-mla")}
        budget_batch = args.long_batch * per_request["all-mla"] // per_request["hybrid"]
    long_models = []
    if ("k3" in sections and longs) or budget_batch:
        long_models.append(("k3 hybrid", base, [(args.long_batch, ctx) for ctx in longs if "k3" in sections]
                            + ([(budget_batch, max(longs))] if budget_batch else [])))
    if "mla" in sections and longs:
        long_models.append(("k3 all-MLA", base.variant(layers="all-mla"), [(args.long_batch, ctx) for ctx in longs]))
    for label, cfg, runs in long_models:
        need = max(B * (ctx + args.steps + 4096 + 16) for B, ctx in runs)
        eng = build_engine(cfg, dev, dtype, tok, need, max(B for B, _ in runs), checkpoint_every=16)
        for B, ctx in runs:
            rate, dt, _, _ = decode_rate(eng, ctx, B, args.steps)
            record({"model": label, "batch": B, "context": ctx, "tokens_per_s": rate, "step_ms": dt * 1e3,
                    "bytes_per_s": step_bytes(eng.model, eng.layout, B, ctx) / dt,
                    "cache_bytes_per_request": _cache_bytes(cfg, dtype, ctx),
                    **({"budget": "all-MLA's cache bytes at batch %d" % args.long_batch}
                       if label == "k3 hybrid" and B == budget_batch and ctx == max(longs) else {})})
        eng.stop()
        del eng
    max_b = max(batches)
    # engine variants at the smallest and largest batch: each step's results read before the next is planned; CUDA
    # graphs of the uncompiled step (what RL rollouts run: a run builds one engine per evaluation)
    variants = {"sync": ("k3 hybrid, synchronous scheduling", {"async_scheduling": False}),
                "nocompile": ("k3 hybrid, graphs without compile", {"compile": False})}
    for section, (label, options) in variants.items():
        if section not in sections:
            continue
        eng = build_engine(base, dev, dtype, tok, max(batches) * (args.context + args.steps + 16), max_b, **options)
        for B in sorted({min(batches), max(batches)}):
            rate, dt, _, _ = decode_rate(eng, args.context, B, args.steps)
            record({"model": label, "batch": B, "context": args.context, "tokens_per_s": rate,
                    "step_ms": dt * 1e3})
        eng.stop()
        del eng
    if "eager" in sections:
        eng = build_engine(base, dev, dtype, tok, args.context + args.steps + 64, 1, graphs=False)
        rate, dt, _, _ = decode_rate(eng, args.context, 1, min(args.steps, 10))
        record({"model": "k3 hybrid, eager (no graphs)", "batch": 1, "context": args.context, "tokens_per_s": rate,
                "step_ms": dt * 1e3})
        eng.stop()
        del eng
    if "peer" in sections and dev.type == "cuda":
        rates, weights = peer_rates(base, dev, dtype, batches, args.context, args.steps)
        for B, r in rates.items():
            record({"model": "dense peer", "batch": B, "context": args.context, "tokens_per_s": r,
                    "bytes_per_s": r / B * (weights + 2 * B * args.context * base.hidden_size * 2 *
                                            base.num_hidden_layers)})
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    summarise(rows, args)
    if args.json:
        Path(args.json).write_text(json.dumps({**header(), "preset": args.preset, "rows": rows}, indent=2))


def summarise(rows, args):
    """The table, then k3 / peer and hybrid / all-MLA ratios."""
    print("\n| model | batch | context | tokens/s | step ms | step min / median / max ms | bytes/s (of 4.3 TB/s) |\n"
          "|---|---|---|---|---|---|---|")
    for r in rows:
        if "tokens_per_s" in r:
            bw = f"{r['bytes_per_s'] / 1e12:.2f} TB/s ({r['bytes_per_s'] / HBM:.0%})" if "bytes_per_s" in r else ""
            sp = r.get("step_spread_ms")
            spread = f"{sp['min']:.3f} / {sp['median']:.3f} / {sp['max']:.3f}" if sp else ""
            if sp and sp["max"] > 5 * sp["median"]:
                spread += (f" (slowest: step {sp['slowest_step']}, during it "
                           f"{sp['during_slowest'] or 'nothing counted'}; allocator over the window: "
                           f"{sp['allocator_during_window'] or 'nothing'})")
            print(f"| {r['model']} | {r['batch']} | {r['context']:,} | {r['tokens_per_s']:,.0f} | "
                  f"{r.get('step_ms', float('nan')):.3f} | {spread} | {bw} |")
    k3 = {(r["batch"], r["context"]): r["tokens_per_s"] for r in rows if r.get("model") == "k3 hybrid" and "batch" in r}
    peer = {r["batch"]: r["tokens_per_s"] for r in rows if r.get("model") == "dense peer"}
    mla = {r["context"]: r for r in rows if r.get("model") == "k3 all-MLA"}
    for B, p in peer.items():
        if (B, args.context) in k3:
            print(f"k3 / dense peer at batch {B}: {k3[(B, args.context)] / p:.2f}x")
    for ctx, r in mla.items():
        hy = next((x for x in rows if x.get("model") == "k3 hybrid" and x.get("context") == ctx
                   and x.get("batch") == r["batch"]), None)
        if hy:
            ratio = r["cache_bytes_per_request"] / hy["cache_bytes_per_request"]
            print(f"context {ctx:,}, batch {r['batch']}: hybrid / all-MLA tokens/s {hy['tokens_per_s'] / r['tokens_per_s']:.2f}x, "
                  f"cache {1 / ratio:.1%} of all-MLA's (at one batch the step-time ratio is bounded by {ratio:.2f}x)")
        bud = next((x for x in rows if x.get("budget") and x.get("context") == ctx), None)
        if bud:
            print(f"context {ctx:,}, the cache bytes of all-MLA at batch {r['batch']}: the hybrid holds {bud['batch']} "
                  f"requests, {bud['tokens_per_s']:,.0f} tokens/s = {bud['tokens_per_s'] / r['tokens_per_s']:.2f}x "
                  "all-MLA's")
    for r in rows:
        if "ttft_miss_s" in r:
            print(f"TTFT {r['ttft_prefix']:,}-token prefix: miss {r['ttft_miss_s']:.3f} s, hit {r['ttft_hit_s']:.4f} s "
                  f"({r['cached_tokens']:,} cached): {r['speedup']:.0f}x")


if __name__ == "__main__":
    main()
