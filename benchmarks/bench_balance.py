"""Expert balancing (SPEC §4.1): Quantile Balancing vs DeepSeek-V3's sign rule (gamma 1e-3), K3's 896 experts
top-16, on synthetic skewed router scores with fresh tokens every step. CPU, about half a minute.

    python benchmarks/bench_balance.py [--steps 20] [--tokens 16384] [--json out.json]

Scores: s = sigmoid(x W + c) with fresh token features x ~ N(0, I_64) each step, a fixed random router W
(logit std 1) and a fixed per-expert offset c ~ N(0, 1) that makes a few experts very popular.
Step t routes batch X_t with the bias b_t, the balancer observes it and sets b_{t+1}. Reported: max/mean expert
load of X_t under b_{t+1} ("in-sample": how well the update fits the tokens it saw) and of X_{t+1} under b_{t+1}
("next batch": the load training meets at the next step). Row 0 is the load with b = 0.
Legend: N tokens, D token features, E experts, k experts per token.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import header  # noqa: E402
from k3.ops.routing import router_scores, select_experts  # noqa: E402
from k3.train.balance import ExpertBalancer  # noqa: E402

E, K, D = 896, 16, 64
METHODS = {"QB": dict(method="quantile"), "QB, 10^4 bins": dict(method="quantile", bins=10_000),
           "sign 1e-3": dict(method="sign", gamma=1e-3)}


def batches(steps: int, N: int, seed: int = 0) -> list[torch.Tensor]:
    """steps + 1 batches of scores [N,E] from one skewed router."""
    g = torch.Generator().manual_seed(seed)
    W, c = torch.randn(D, E, generator=g) / D**0.5, torch.randn(E, generator=g)  # [D,E], [E]
    return [router_scores(torch.randn(N, D, generator=g) @ W + c) for _ in range(steps + 1)]


def max_over_mean(scores: torch.Tensor, bias: torch.Tensor) -> float:
    return max_over_mean_idx(select_experts(scores, bias, K)[1])


def uniform_floor(N: int, trials: int = 20, seed: int = 1) -> float:
    """max/mean load of a perfectly balanced router on N fresh tokens (each picks k distinct uniform experts):
    the sampling noise no bias can remove."""
    g = torch.Generator().manual_seed(seed)
    idx = [torch.rand(N, E, generator=g).topk(K, dim=-1).indices for _ in range(trials)]
    return sum(max_over_mean_idx(i) for i in idx) / trials


def max_over_mean_idx(idx: torch.Tensor) -> float:
    load = torch.bincount(idx.flatten(), minlength=E).double()
    return (load.max() / load.mean()).item()


def run(data: list[torch.Tensor], **kw) -> tuple[list[float], list[float], float]:
    """-> (in-sample, next-batch) max/mean load per step, seconds per observe+step."""
    router = SimpleNamespace(e_score_correction_bias=torch.zeros(E), top_k=K)
    bal = ExpertBalancer([router], **kw)
    in_sample, next_batch, spent = [], [max_over_mean(data[0], router.e_score_correction_bias)], 0.0
    for t in range(len(data) - 1):
        t0 = time.perf_counter()
        bal.observe([(data[t], select_experts(data[t], router.e_score_correction_bias, K)[1])])
        bal.step()
        spent += time.perf_counter() - t0
        in_sample.append(max_over_mean(data[t], router.e_score_correction_bias))
        next_batch.append(max_over_mean(data[t + 1], router.e_score_correction_bias))
    return in_sample, next_batch, spent / (len(data) - 1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--tokens", type=int, default=16384, help="tokens per step (mean load = tokens * 16 / 896)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    data = batches(args.steps, args.tokens)
    res = {name: run(data, **kw) for name, kw in METHODS.items()}
    floor = uniform_floor(args.tokens)
    out = {**header(), "experts": E, "top_k": K, "tokens_per_step": args.tokens, "uniform_routing_floor": floor,
           "results": {n: {"in_sample": a, "next_batch": b, "s_per_step": s} for n, (a, b, s) in res.items()}}
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    print(f"{out['date']}, commit {out['commit']}, {out['machine']}, torch {out['torch']}; E={E}, k={K}, "
          f"{args.tokens} fresh tokens per step (mean load {args.tokens * K / E:.0f} per expert)\n")
    names = list(METHODS)
    print("| step | " + " | ".join(f"{n} in-sample | {n} next batch" for n in names) + " |")
    print("|---|" + "---|---|" * len(names))
    print("| 0 (b = 0) | " + " | ".join(f"- | {res[n][1][0]:.3f}" for n in names) + " |")
    for t in range(args.steps):
        print(f"| {t + 1} | " + " | ".join(f"{res[n][0][t]:.3f} | {res[n][1][t + 1]:.3f}" for n in names) + " |")
    print(f"\nSampling floor (uniform random top-{K} on {args.tokens} tokens, mean of 20 draws): {floor:.3f}")
    print("Seconds per observe + step: " + ", ".join(f"{n} {res[n][2]:.3f}" for n in names))


if __name__ == "__main__":
    main()
