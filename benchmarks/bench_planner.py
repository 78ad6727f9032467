"""MoonEP planner (SPEC §8): planning time, and the imbalance it removes, at K3's E = 896 for R in {8, 32, 64, 128}.
CPU, about five seconds.

    python benchmarks/bench_planner.py [--loads 20] [--zipf 0.5,1.0] [--json out.json]

Loads: S*K = 4096 * 8 tokens per rank, R*S*K in all, drawn Multinomial(R*S*K, p) over experts with Zipf-like
popularity p_e ∝ rank_e^-s (experts shuffled, so the hot ones fall on random ranks). Reported per (R, s), over
the loads: median wall time of plan() and plan_arrays(); max/mean tokens per rank of plain EP (each rank computes
only its own experts) and of MoonEP (1 by construction); the most and the mean replica experts a rank hosts,
against Theorem 1's bound E/R and Theorem 2's worst-case need ceil(E(R-1)/R^2).
Legend: E experts, R ranks, S tokens per rank, K experts per token.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import header  # noqa: E402
from k3.distributed.moonep import plan, plan_arrays, validate  # noqa: E402

E, S, K = 896, 4096, 8
RANKS = (8, 32, 64, 128)


def zipf_loads(R: int, s: float, seed: int) -> torch.Tensor:
    """[E] int64 token counts summing to R*S*K, popularity ∝ rank^-s over shuffled experts: a multinomial drawn as
    conditional binomials (x_e ~ Bin(tokens left, p_e / mass left)), E draws instead of R*S*K."""
    g = torch.Generator().manual_seed(seed)
    p = (torch.arange(1, E + 1, dtype=torch.float64) ** -s)[torch.randperm(E, generator=g)]  # [E]
    q = (p / p.flip(0).cumsum(0).flip(0)).clamp(max=1.0)  # [E] p_e / mass of experts e..E-1; the last is 1
    out, left = [], torch.tensor([float(R * S * K)], dtype=torch.float64)
    for e in range(E):
        x = torch.binomial(left, q[e:e + 1], generator=g)
        out.append(int(x.item()))
        left = left - x
    return torch.tensor(out, dtype=torch.int64)


def median_ms(fn, repeats: int = 5) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def measure(R: int, s: float, n_loads: int) -> dict:
    m, plan_ms, arrays_ms, ep_imbalance, moon_imbalance, max_rep, mean_rep = E // R, [], [], [], [], [], []
    for seed in range(n_loads):
        loads = zipf_loads(R, s, seed)
        rows = plan(loads, R)
        validate(rows, loads, R)
        plan_ms.append(median_ms(lambda: plan(loads, R)))
        arrays_ms.append(median_ms(lambda: plan_arrays(loads, R)))
        ep = loads.view(R, m).sum(1).double()  # [R] plain EP: own experts only
        ep_imbalance.append((ep.max() / ep.mean()).item())
        moon = torch.tensor([sum(t for _, t in row) for row in rows], dtype=torch.float64)
        moon_imbalance.append((moon.max() / moon.mean()).item())
        reps = [sum(e // m != r for e, _ in row) for r, row in enumerate(rows)]
        max_rep.append(max(reps))
        mean_rep.append(sum(reps) / R)
    return {"R": R, "experts_per_rank": m, "zipf_s": s, "plan_ms": statistics.median(plan_ms),
            "plan_arrays_ms": statistics.median(arrays_ms), "plain_ep_max_over_mean": statistics.mean(ep_imbalance),
            "plain_ep_max_over_mean_worst": max(ep_imbalance), "moonep_max_over_mean": max(moon_imbalance),
            "max_replicas_per_rank": max(max_rep), "mean_replicas_per_rank": statistics.mean(mean_rep),
            "bound": m, "theorem2_need": math.ceil(E * (R - 1) / R**2)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--loads", type=int, default=20, help="random loads per (R, s)")
    ap.add_argument("--zipf", default="0.5,1.0", help="comma-separated Zipf exponents s")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    rows = [measure(R, float(s), args.loads) for s in args.zipf.split(",") for R in RANKS]
    out = {**header(), "experts": E, "tokens_per_rank": S * K, "loads": args.loads, "results": rows}
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    print(f"{out['date']}, commit {out['commit']}, {out['machine']}, torch {out['torch']}; E={E}, S*K={S}*{K} tokens "
          f"per rank, {args.loads} Zipf loads per row\n")
    print("| R | E/R | Zipf s | plan() ms | plan_arrays() ms | plain EP max/mean (mean, worst) | MoonEP max/mean "
          "| replicas/rank max (mean) | bound E/R | Thm 2 worst-case need |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['R']} | {r['experts_per_rank']} | {r['zipf_s']} | {r['plan_ms']:.2f} | {r['plan_arrays_ms']:.2f} "
              f"| {r['plain_ep_max_over_mean']:.2f}, {r['plain_ep_max_over_mean_worst']:.2f} "
              f"| {r['moonep_max_over_mean']:.2f} | {r['max_replicas_per_rank']} ({r['mean_replicas_per_rank']:.2f}) "
              f"| {r['bound']} | {r['theorem2_need']} |")


if __name__ == "__main__":
    main()
