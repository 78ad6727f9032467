"""Shared helpers for benchmarks: CUDA-event timing, a results header (date, commit, machine), and the counts of
what can stall a timed step."""

from __future__ import annotations

import datetime
import gc
import os
import platform
import statistics
import subprocess
import time

import torch
from torch._dynamo.utils import counters


def host_counters(device, allocator: bool = True) -> dict:
    """Running counts of what can stall a step on the host: dynamo compilations, garbage collections, and on CUDA
    (``allocator``) the caching allocator's cudaMalloc retries and segments. The difference over a slow step says
    what happened. ``torch.cuda.memory_stats`` costs tens of microseconds: leave it out between sub-millisecond
    steps."""
    out = {"dynamo_graphs": sum(counters["stats"].values()) if "stats" in counters else 0,
           "gc": sum(g["collections"] for g in gc.get_stats())}
    if allocator and torch.device(device).type == "cuda":
        m = torch.cuda.memory_stats(device)
        out.update(alloc_retries=m.get("num_alloc_retries", 0), segments=m.get("segment.all.allocated", 0))
    return out


def slowest(each: list[float], counts: list[dict]) -> dict:
    """The slowest of the timed steps ``each`` and what changed during it (``counts``: one more than ``each``, the
    counters before the first step and after each)."""
    worst = max(range(len(each)), key=each.__getitem__)
    return {"slowest_step": worst, "during_slowest": {k: counts[worst + 1][k] - counts[worst][k] for k in counts[0]
                                                      if counts[worst + 1][k] != counts[worst][k]}}


def header() -> dict:
    commit = os.environ.get("K3_COMMIT", "")  # set it where the tree is a copy whose .git may be stale
    if not commit:
        try:
            commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                    text=True).stdout.strip()
        except OSError:
            commit = ""
    dev = torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor() or "cpu"
    return {"date": datetime.date.today().isoformat(), "commit": commit or "unknown", "machine": dev,
            "torch": torch.__version__}


def cuda_time_ms(fn, warmup: int = 3, iters: int = 10) -> float:
    """Median wall time of fn() in ms, measured with CUDA events around each call."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return sorted(times)[len(times) // 2]


def graph_time_us(fn, calls: int = 20) -> float:
    """GPU time of one fn() in us: a CUDA graph of ``calls`` calls, replayed (median of 10 replays)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls):
            fn()
    return cuda_time_ms(g.replay, warmup=2, iters=10) * 1e3 / calls


def cpu_time_ms(fn, warmup: int = 1, iters: int = 3) -> float:
    """Median wall time of fn() in ms (CPU runs)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append(1e3 * (time.perf_counter() - t0))
    return statistics.median(times)


def rel_rms(ref, out) -> float:
    """||out - ref|| / ||ref|| in RMS terms, in fp32."""
    ref, out = ref.float(), out.float()
    return ((ref - out).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt().clamp_min(1e-12)).item()


def kda_inputs(B: int, T: int, H: int, D: int, device="cuda", dtype=torch.bfloat16, requires_grad: bool = False):
    """[q, k, v, g, beta] as every KDA benchmark uses them: q, v random in ``dtype``, k L2-normalised (in fp32, then
    cast), fp32 log-decay gates spanning (-5, 0) (K3's floor), fp32 beta in (0, 1)."""
    import torch.nn.functional as F

    q = torch.randn(B, T, H, D, device=device, dtype=dtype)
    k = F.normalize(torch.randn(B, T, H, D, device=device), dim=-1).to(dtype)
    v = torch.randn(B, T, H, D, device=device, dtype=dtype)
    g = -5 * torch.rand(B, T, H, D, device=device)
    beta = torch.rand(B, T, H, device=device)
    return [x.requires_grad_(requires_grad) for x in (q, k, v, g, beta)]
