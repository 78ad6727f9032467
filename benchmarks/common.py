"""Shared helpers for benchmarks: CUDA-event timing and a results header (date, commit, machine)."""

from __future__ import annotations

import datetime
import os
import platform
import statistics
import subprocess
import time

import torch


def header() -> dict:
    commit = os.environ.get("K3_COMMIT", "")  # set it where the tree is a copy whose .git may be stale
    if not commit:
        try:
            commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
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
