"""Training throughput and MFU of K3 models against a dense same-width peer, in one run.

    python benchmarks/bench_train.py                                  # small and medium, uniform and corpus, + peers
    python benchmarks/bench_train.py --compile --memory-policy efficient --profile runs/profile
    python benchmarks/bench_train.py --presets tiny --batch 2 --seq-len 128 --steps 2 --warmup 1 \\
        --vocab-size 512 --data-max-bytes 300000                      # CPU smoke run

K3 rows: the `k3 train` step (k3.distributed.plan.ParallelPlan with every size 1: the loss, MTP and QK-clip
tracking; backward; Quantile Balancing; gradient clipping; Muon + AdamW; QK-clip), bf16 autocast on CUDA, with the
chosen ``--memory-policy`` and ``--compile`` (regional). ``--docs``: "uniform" packs ``--batch`` documents of
exactly ``--seq-len`` tokens per step (the kernels' best case); "corpus" feeds what `k3 train` feeds: the embedded
standard-library corpus through `k3 train`'s own data step (its training split of ``--data-max-bytes``, a byte-level
BPE of ``--vocab-size``, documents packed into samples of ``--seq-len`` tokens, ``--batch`` samples per step, a new
batch every step, in the run's order);
"stream" the same corpus as `k3 train --packing stream` packs it (each sample one segment).
``--cuda-graph``: every K3 row replays the step's forward and backward as one CUDA graph (`k3 train --cuda-graph`,
k3.train.graph; the corpus's boundaries are data in the graph's buffers); ``--cuda-graph small`` only those presets'
rows (a graph keeps its activation pool beside the optimiser's memory: ``medium`` at 8 x 4096 runs without).

Peer rows ("dense"): plain PyTorch written here, the model a K3 row would be without its mechanisms, at the same
width and depth: pre-norm RMSNorm, causal SDPA attention (head dim 64, or 128 from hidden 2048 up), SwiGLU MLP of
8/3 x hidden (rounded to 256), untied head, ``--batch`` rows of ``--seq-len`` tokens, fused AdamW, bf16 autocast,
``torch.compile`` of the whole model with ``--compile``. The peer attends across the whole row (no document mask):
its speed does not depend on the data, so it runs once per width.

MFU = model FLOPs per step / step time / peak (``--peak-tflops``, default 780: measured bf16 dense matmul on an H200).
Model FLOPs: 6 x N x tokens plus attention. N = active parameters without the input embedding, the head included,
plus what the MTP loss multiplies per token (``count_parameters``' ``mtp_active``: the MTP layer's parameters, k of E
routed experts, and its pass through the shared head; Megatron-LM counts MTP's head and projection the same way);
"MFU w/o MTP" leaves that out (the trunk and head only: SPEC §1's active count). Attention,
forward + backward = 3 x forward, per document (K3) or row (peer) of T tokens and per attention layer (the MTP
layer's MLA included):
  causal softmax attention (K3's MLA, the peer):  3 * T^2 * H * (d_qk + d_v)     (2 FLOPs per MAC, half the pairs)
  KDA, chunked (chunk C = 64):                    3 * T * H * (4 * K * V + 2 * C * (K + V))
Step time: each step ends with one read of the device (as `k3 train`); min / median / max over ``--steps``.
Peak memory: ``torch.cuda.max_memory_allocated`` / ``max_memory_reserved`` over the timed steps (CUDA; a CUDA graph's
pool counts only in the reserved figure).

``--profile DIR``: one more step per row (``--profile-steps`` N: N more) under torch.profiler; DIR/<row>.txt holds
the ops and kernels of most device time, the device's idle gaps between kernels (host-bound stretches), largest
first, and the device time per module class, forward and backward apart (which layer's code to fuse first).
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import statistics
import sys
import time
from collections import Counter
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import header, host_counters, slowest  # noqa: E402
from k3 import K3Config, K3ForCausalLM  # noqa: E402
from k3.distributed.plan import ParallelDims, ParallelPlan  # noqa: E402
from k3.model.params import count_parameters  # noqa: E402
from k3.train.loop import TrainConfig  # noqa: E402
from k3.train.memory import POLICIES  # noqa: E402
from k3.train.trainer import Trainer  # noqa: E402


def attention_flops(T_squared: float, layers: int, heads: int, d_qk: int, d_v: int) -> float:
    """Forward + backward FLOPs of causal softmax attention over documents whose squared lengths sum to T_squared."""
    return layers * 3 * T_squared * heads * (d_qk + d_v)


def k3_flops(cfg: K3Config, tokens: int, sq_tokens: float, mtp: bool = True) -> float:
    """Model FLOPs of one K3 step of ``tokens`` tokens whose documents' squared lengths sum to ``sq_tokens``
    (``mtp=False``: without the MTP loss's parameters)."""
    counts = count_parameters(cfg)
    dense = 6 * (counts["active"] + (counts["mtp_active"] if mtp else 0)) * tokens
    n_mla = len(cfg.full_attn_layers) + cfg.num_nextn_predict_layers
    mla = attention_flops(sq_tokens, n_mla, cfg.num_attention_heads, cfg.qk_head_dim, cfg.v_head_dim)
    K = cfg.kda_head_dim
    kda = len(cfg.kda_layers) * 3 * tokens * cfg.kda_num_heads * (4 * K * K + 2 * 64 * 2 * K)
    return dense + mla + kda


# ---------------------------------------------------------------- the dense peer


class DenseBlock(nn.Module):
    def __init__(self, D: int, H: int, I: int):
        super().__init__()
        self.H = H
        self.attn_norm, self.mlp_norm = nn.RMSNorm(D), nn.RMSNorm(D)
        self.qkv, self.out = nn.Linear(D, 3 * D, bias=False), nn.Linear(D, D, bias=False)
        self.gate_up, self.down = nn.Linear(D, 2 * I, bias=False), nn.Linear(I, D, bias=False)

    def forward(self, x):  # x [B,T,D]
        B, T, D = x.shape
        q, k, v = self.qkv(self.attn_norm(x)).view(B, T, 3, self.H, D // self.H).permute(2, 0, 3, 1, 4)  # [B,H,T,hd]
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.out(a.transpose(1, 2).reshape(B, T, D))
        g, u = self.gate_up(self.mlp_norm(x)).chunk(2, dim=-1)
        return x + self.down(F.silu(g) * u)


class DensePeer(nn.Module):
    """A plain dense decoder: what K3 at this width and depth would be without KDA, MLA, AttnRes and MoE."""

    def __init__(self, vocab: int, D: int, layers: int):
        super().__init__()
        self.head_dim = 128 if D >= 2048 else 64
        self.H, self.I = D // self.head_dim, 256 * round(8 * D / 3 / 256)
        self.embed = nn.Embedding(vocab, D)
        self.blocks = nn.ModuleList(DenseBlock(D, self.H, self.I) for _ in range(layers))
        self.norm, self.head = nn.RMSNorm(D), nn.Linear(D, vocab, bias=False)

    def forward(self, ids):  # ids [B,T] -> next-token loss
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.norm(x)).float()
        return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))

    def flops(self, B: int, T: int) -> float:
        n = sum(p.numel() for p in self.parameters()) - self.embed.weight.numel()
        return 6 * n * B * T + attention_flops(B * T**2, len(self.blocks), self.H, self.head_dim, self.head_dim)


# ---------------------------------------------------------------- timing and profiling


def device_gaps(prof, top: int = 10) -> str:
    """The device's idle time between kernels in a profiled step: total, share of the step, the largest gaps."""
    from torch.autograd import DeviceType

    kernels = sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                     if e.device_type == DeviceType.CUDA)
    if not kernels:
        return "device gaps: no device kernels recorded (a CPU run)\n"
    gaps, busy, end, last = [], 0.0, kernels[0][0], kernels[0][2]
    for s, e, name in kernels:
        if s > end:
            gaps.append((s - end, last, name))
        busy += max(0.0, e - max(s, end))
        if e > end:
            end, last = e, name
    span = end - kernels[0][0]
    lines = [f"device gaps: idle {(span - busy) / 1e3:.2f} ms of {span / 1e3:.2f} ms ({(span - busy) / span:.1%}), "
             f"{len(gaps)} gaps between {len(kernels)} kernels; largest:"]
    for us, before, after in sorted(gaps, reverse=True)[:top]:
        lines.append(f"  {us / 1e3:8.3f} ms  after {before[:60]}  before {after[:60]}")
    return "\n".join(lines) + "\n"


@contextmanager
def module_ranges(model):
    """Every module's forward as a profiler range "fwd::<class>" (the innermost names the kernels it launches)."""
    from torch.profiler import record_function

    if model is None:
        yield
        return
    stack = []

    def pre(mod, args):
        stack.append(record_function(f"fwd::{type(mod).__name__}"))
        stack[-1].__enter__()

    def post(mod, args, out):
        stack.pop().__exit__(None, None, None)

    hooks = [h for m in model.modules() for h in (m.register_forward_pre_hook(pre), m.register_forward_hook(post))]
    try:
        yield
    finally:
        for h in hooks:
            h.remove()


def by_module(prof, device: str, top: int = 25) -> str:
    """Device time (CPU time on CPU) per module class, forward and backward apart. A backward op is charged to the
    module whose forward op created its autograd node (the profiler's sequence numbers tie the two)."""
    events = prof.events()

    def module_of(e):
        while e is not None and not e.name.startswith("fwd::"):
            e = e.cpu_parent
        return e.name[5:] if e is not None else None

    created = {}
    for e in events:
        if e.sequence_nr >= 0 and not e.name.startswith("autograd::"):
            created.setdefault(e.sequence_nr, module_of(e))
    spent = Counter()
    for e in events:
        if e.name.startswith(("fwd::", "autograd::")) or (device != "cuda" and e.cpu_children):
            continue
        t = e.self_device_time_total if device == "cuda" else e.self_cpu_time_total
        if t <= 0:
            continue
        mod = module_of(e)
        if mod is not None:
            spent[f"forward  {mod}"] += t
            continue
        node = e
        while node is not None and not node.name.startswith("autograd::engine::evaluate_function"):
            node = node.cpu_parent
        spent[f"backward {created.get(node.sequence_nr) or '?'}" if node is not None else "outside the model"] += t
    total = sum(spent.values()) or 1
    lines = [f"{'device' if device == 'cuda' else 'CPU'} time by module (innermost class):"]
    lines += [f"  {us / 1e3:9.2f} ms {us / total:6.1%}  {name}" for name, us in spent.most_common(top)]
    return "\n".join(lines) + "\n"


def by_shape(prof, device: str, top: int = 40) -> str:
    """The ops of most device time by op and input shapes (which call site of a common op, e.g. aten::mul, costs)."""
    key = "self_device_time_total" if device == "cuda" else "self_cpu_time_total"
    avg = sorted(prof.key_averages(group_by_input_shape=True), key=lambda e: -getattr(e, key))
    lines = ["ops by input shape (self time, calls, shapes):"]
    for e in avg[:top]:
        lines.append(f"  {getattr(e, key) / 1e3:9.2f} ms x{e.count:<5} {e.key[:40]:40} {str(e.input_shapes)[:150]}")
    return "\n".join(lines) + "\n"


def profile_step(step, device: str, path: Path, top: int = 40, model=None, trace: bool = False, steps: int = 1) -> None:
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with module_ranges(model):
        float(step())  # the module hooks make dynamo recompile the compiled regions: here, not in the profiled step
        with profile(activities=acts, record_shapes=True) as prof:
            for _ in range(steps):  # several: what happens between one step and the next shows too
                float(step())
    key = "self_cuda_time_total" if device == "cuda" else "self_cpu_time_total"
    table = prof.key_averages().table(sort_by=key, row_limit=top, max_name_column_width=80)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(table + "\n" + device_gaps(prof) + "\n" + by_module(prof, device) + "\n" + by_shape(prof, device))
    if trace:  # the whole timeline, gzipped (chrome://tracing, ui.perfetto.dev)
        import gzip
        raw = path.with_suffix(".json")
        prof.export_chrome_trace(str(raw))
        with open(raw, "rb") as f, gzip.open(str(raw) + ".gz", "wb") as g:
            g.write(f.read())
        raw.unlink()
    print(f"# profile written to {path}", flush=True)


def timed(step, warmup: int, steps: int, device: str) -> tuple[list[float], float, dict]:
    """(per-step ms, last loss, the slowest step and what happened during it): ``warmup`` untimed steps, then
    ``steps`` each ending in one read of the device."""
    for _ in range(warmup):  # fla's autotuning, torch.compile, the allocator
        float(step())
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    each, loss, counts = [], float("nan"), [host_counters(device)]
    for _ in range(steps):
        t = time.perf_counter()
        loss = float(step())
        each.append((time.perf_counter() - t) * 1e3)
        counts.append(host_counters(device))
    return each, loss, slowest(each, counts)


def row_stats(preset: str, name: str, docs: str, each: list[float], tokens: int, flops: float, peak: float,
              device: str, **extra) -> dict:
    med = statistics.median(each)
    return {"preset": preset, "model": name, "docs": docs, "tokens_per_s": tokens / (med / 1e3),
            "mfu": flops / (med / 1e3) / peak if device == "cuda" else None,
            "step_ms": {"min": min(each), "median": med, "max": max(each)}, "each_step_ms": [round(x, 1) for x in each],
            "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else None,
            "peak_reserved_gib": torch.cuda.max_memory_reserved() / 2**30 if device == "cuda" else None, **extra}


# ---------------------------------------------------------------- rows


def corpus_batches(batch: int, T: int, vocab_size: int, max_bytes: int):
    """(vocab, a function of ``boundaries`` giving endless batches {"input_ids" [1, batch*T], "cu_seqlens"}): the
    training split `k3 train --data-max-bytes max_bytes --vocab-size vocab_size --seq-len T --batch-size batch`
    trains on, through its own data step (``k3.train.data.prepare``: the same documents, BPE, packing and order),
    ``--packing documents`` (True) or ``stream`` (False); the tokenizer is learned once."""
    import tempfile
    from types import SimpleNamespace

    from k3.train.data import prepare

    cfg = TrainConfig(out="-", vocab_size=vocab_size, data_max_bytes=max_bytes, seq_len=T, batch_size=batch)
    with tempfile.TemporaryDirectory() as run:  # where k3 train writes its tokenizer.json
        data = prepare(cfg, Path(run), None, SimpleNamespace(rank=0, barrier=lambda: None))

    def batches(boundaries: bool):
        packed = copy.copy(data.train)  # the same tokens and order, its own position; documents marked or not
        packed.boundaries = boundaries
        return packed.batches(batch)

    return data.tokenizer.get_vocab_size(), batches


def k3_rows(preset: str, cfg: K3Config, args, batches=None, kind: str = "uniform") -> dict:
    """``k3_row`` under the first of ``--memory-policy``'s policies whose step fits in the device's memory (the row
    names it, and the policies that ran out of memory before it)."""
    oom = []
    for policy in args.memory_policy.split(","):
        try:
            row = k3_row(preset, cfg, args, policy, batches, kind)
            return {**row, "oom_policies": oom} if oom else row
        except torch.OutOfMemoryError as e:
            oom.append(policy)
            print(f"# k3 {preset}: out of memory under {policy!r}: {str(e).splitlines()[0][:200]}", flush=True)
        gc.collect()  # the failed step's model, optimiser state and activations, before the next policy
        if args.device == "cuda":
            torch.cuda.empty_cache()
    return {"preset": preset, "model": f"k3 {preset}", "docs": kind, "oom_policies": oom}


def k3_row(preset: str, cfg: K3Config, args, policy: str, batches=None, kind: str = "uniform") -> dict:
    """One K3 row: ``batches`` (endless packed batches) or None for uniform documents; the step is `k3 train`'s
    (``Trainer.step``), replayed as a CUDA graph with ``--cuda-graph``."""
    device = args.device
    torch.manual_seed(0)
    model = K3ForCausalLM(cfg).to(device)
    graphed = args.cuda_graph is not None and (args.cuda_graph == "all" or preset in args.cuda_graph.split(","))
    tcfg = TrainConfig(out="-", steps=1_000_000, lr=1e-3, warmup_frac=0.0, mtp_weight=0.3, qk_clip_tau=100.0,
                       kda_backend=args.kda_backend, memory_policy=policy, compile=args.compile, cuda_graph=graphed)
    trainer = Trainer(tcfg, ParallelPlan(ParallelDims(), device=device), model, log=lambda *a: None)
    B, T = args.batch, args.seq_len
    uniform = {"input_ids": torch.randint(0, cfg.vocab_size, (1, B * T)), "cu_seqlens": torch.arange(0, B * T + 1, T)}
    docs, sq, load = [], [], []

    def step():
        batch = next(batches) if batches is not None else uniform
        cu = batch["cu_seqlens"]
        docs.append(len(cu) - 1)
        sq.append(float(cu.diff().double().pow(2).sum()))
        rec = trainer.step([batch])
        load.append(rec["load_max_over_mean"])  # the worst layer's routed-token max/mean
        return rec["loss"]

    each, loss, slow = timed(step, args.warmup, args.steps, device)
    n = args.steps
    sq_mean = sum(sq[-n:]) / n
    flops = k3_flops(cfg, B * T, sq_mean)
    row = row_stats(preset, f"k3 {preset}", kind, each, B * T, flops, args.peak_tflops * 1e12, device,
                    memory_policy=policy, cuda_graph=graphed, graph_captures=trainer.graph.captures if graphed else 0,
                    docs_per_step=sum(docs[-n:]) / n, loss=loss, load_max_over_mean=[round(x, 2) for x in load[-n:]],
                    **slow)
    row["mfu_without_mtp"] = row["mfu"] and row["mfu"] * k3_flops(cfg, B * T, sq_mean, mtp=False) / flops
    if args.profile:
        profile_step(step, device, Path(args.profile) / f"k3-{preset}-{kind}.txt", model=model,
                     trace=args.trace, steps=args.profile_steps)
    return row


def peer_row(preset: str, cfg: K3Config, args) -> dict:
    device = args.device
    torch.manual_seed(0)
    model = DensePeer(cfg.vocab_size, cfg.hidden_size, cfg.num_hidden_layers).to(device).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1, fused=True)  # CPU too
    fwd = torch.compile(model) if args.compile else model
    B, T = args.batch, args.seq_len
    ids = torch.randint(0, cfg.vocab_size, (B, T), device=device)
    amp = torch.autocast("cuda", dtype=torch.bfloat16) if device == "cuda" else torch.autocast("cpu", enabled=False)

    def step():
        with amp:
            loss = fwd(ids)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    each, loss, slow = timed(step, args.warmup, args.steps, device)
    row = row_stats(preset, f"dense {cfg.hidden_size} x {cfg.num_hidden_layers}", "any", each, B * T, model.flops(B, T),
                    args.peak_tflops * 1e12, device, params=sum(p.numel() for p in model.parameters()), loss=loss,
                    **slow)
    if args.profile:
        profile_step(step, device, Path(args.profile) / f"dense-{preset}.txt", model=model)
    return row


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--presets", default="small,medium")
    ap.add_argument("--docs", default="uniform,corpus", help="comma-separated, of uniform, corpus, stream (see above)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--no-peer", action="store_true", help="leave out the dense peer")
    ap.add_argument("--kda-backend", choices=["auto", "torch", "fla"], default="auto")
    ap.add_argument("--memory-policy", default="keep", help=f"one of {', '.join(sorted(POLICIES))}, or several "
                    "(comma-separated): each K3 row runs under the first whose step fits in memory")
    ap.add_argument("--compile", action="store_true", help="regional torch.compile for K3, whole-model for the peer")
    ap.add_argument("--cuda-graph", nargs="?", const="all", default=None, metavar="PRESETS",
                    help="K3 rows: the step's forward and backward replayed as one CUDA graph (k3 train --cuda-graph); "
                    "with a comma-separated list of presets, those presets' rows only")
    ap.add_argument("--vocab-size", type=int, default=32768, help="--docs corpus: the BPE's size (k3 train's default)")
    ap.add_argument("--data-max-bytes", type=int, default=3_000_000, help="--docs corpus: bytes of the corpus "
                    "(k3 train's --data-max-bytes; gpu_session.sh ktrain runs k3 train on the same 3 MB)")
    ap.add_argument("--peak-tflops", type=float, default=780.0, help="the device's bf16 peak for MFU")
    ap.add_argument("--profile", default=None, metavar="DIR", help="profile one extra step per row into DIR")
    ap.add_argument("--profile-steps", type=int, default=1, help="with --profile: steps in the profiled window")
    ap.add_argument("--trace", action="store_true", help="with --profile: also each K3 row's timeline, DIR/<row>.json.gz")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    bad = set(args.memory_policy.split(",")) - set(POLICIES)
    if bad:
        ap.error(f"--memory-policy: unknown {sorted(bad)}; choose from {', '.join(sorted(POLICIES))}")
    graphs = set(args.cuda_graph.split(",")) - {"all"} if args.cuda_graph else set()
    if graphs - set(args.presets.split(",")):
        ap.error(f"--cuda-graph: {sorted(graphs - set(args.presets.split(',')))} not in --presets {args.presets}")
    kinds = args.docs.split(",")
    if set(kinds) - {"uniform", "corpus", "stream"}:
        ap.error(f"--docs: unknown {sorted(set(kinds) - {'uniform', 'corpus', 'stream'})}; choose from uniform, "
                 "corpus, stream")
    corpus = corpus_batches(args.batch, args.seq_len, args.vocab_size, args.data_max_bytes) \
        if {"corpus", "stream"} & set(kinds) else None
    rows = []
    for preset in args.presets.split(","):
        cfg = K3Config.preset(preset)
        for kind in kinds:
            if kind in ("corpus", "stream"):
                rows.append(k3_rows(preset, cfg.replace(vocab_size=corpus[0]), args, corpus[1](kind == "corpus"), kind))
            else:
                rows.append(k3_rows(preset, cfg, args))
            print(json.dumps(rows[-1]), flush=True)
        if not args.no_peer:
            rows.append(peer_row(preset, cfg, args))
            print(json.dumps(rows[-1]), flush=True)
        if args.device == "cuda":
            torch.cuda.empty_cache()
    report(rows, args)


def report(rows: list[dict], args) -> None:
    print(f"\n{args.batch} x {args.seq_len} tokens per step on {args.device}; compile {'on' if args.compile else 'off'}, "
          f"KDA backend {args.kda_backend}")
    print("| model | documents | memory policy | CUDA graph | docs/step | tokens/s | MFU (w/o MTP) | "
          "step min / median / max | peak memory (allocated / reserved) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        oom = f" ({', '.join(r['oom_policies'])}: out of memory)" if r.get("oom_policies") else ""
        if "step_ms" not in r:
            print(f"| {r['model']} | {r['docs']} | -{oom} | - | - | - | - | - | - |")
            continue
        s = r["step_ms"]
        mfu = f"{r['mfu']:.1%}" if r["mfu"] is not None else "-"
        if r.get("mfu_without_mtp") is not None:
            mfu += f" ({r['mfu_without_mtp']:.1%})"
        # under a CUDA graph the replays use the graph's own pool, which max_memory_allocated does not count
        mem = f"{r['peak_mem_gib']:.1f} / {r['peak_reserved_gib']:.1f} GiB" if r["peak_mem_gib"] is not None else "-"
        docs = f"{r['docs_per_step']:.1f}" if "docs_per_step" in r else "-"
        graph = {True: "yes", False: "no"}.get(r.get("cuda_graph"), "-")
        print(f"| {r['model']} | {r['docs']} | {r.get('memory_policy', '-')}{oom} | {graph} | {docs} | "
              f"{r['tokens_per_s']:,.0f} | "
              f"{mfu} | {s['min']:.0f} / {s['median']:.0f} / {s['max']:.0f} ms | {mem} |")
    for preset in args.presets.split(","):
        by = {r["docs"]: r for r in rows if r["preset"] == preset and "step_ms" in r}
        peer = by.pop("any", None)
        for kind in ("corpus", "stream"):
            if "uniform" in by and kind in by:
                u, c = by["uniform"], by[kind]
                print(f"k3 {preset}: {kind} / uniform tokens/s {c['tokens_per_s'] / u['tokens_per_s']:.2f}x; {kind} "
                      f"step spread {c['step_ms']['min'] / c['step_ms']['median'] - 1:+.0%} / "
                      f"{c['step_ms']['max'] / c['step_ms']['median'] - 1:+.0%} around its median")
        for r in by.values():
            if r["step_ms"]["max"] > 1.1 * r["step_ms"]["median"]:
                print(f"k3 {preset} {r['docs']}: slowest step {r['slowest_step']} "
                      f"({r['step_ms']['max'] / r['step_ms']['median'] - 1:+.0%}), during it: "
                      f"{r['during_slowest'] or 'nothing counted'}")
        if peer is not None and "uniform" in by:
            print(f"k3 {preset} / dense peer tokens/s: {by['uniform']['tokens_per_s'] / peer['tokens_per_s']:.2f}x")
    if args.json:
        Path(args.json).write_text(json.dumps({**header(), "args": vars(args), "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
