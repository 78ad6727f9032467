"""Training throughput and MFU of a K3 model (SPEC §5 recipe: Muon + AdamW, Quantile Balancing, MTP, QK-clip),
the fla backend against the pure-torch KDA reference on the same model, in one run.

    python benchmarks/bench_train.py [--preset small] [--batch 8 --seq-len 4096] [--steps 10] [--json out.json]

MFU = (6 * active_params * tokens + attention FLOPs) / time / peak, peak = 780 TFLOP/s (measured bf16 on the H200).
Attention FLOPs per sequence of T tokens, forward + backward (3x forward):
  MLA (causal):  3 * T^2 * H * (d_qk + d_v)
  KDA (chunked): 3 * T * H * (4 * K * V + 2 * C * (K + V)), C = 64
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
from k3.model.params import count_parameters  # noqa: E402
from k3.train.balance import ExpertBalancer  # noqa: E402
from k3.train.optim import build_optimizer  # noqa: E402
from k3.train.qk_clip import enable_max_logit_tracking, qk_clip_  # noqa: E402

PEAK = 780e12


def flops_per_step(cfg: K3Config, batch: int, T: int) -> float:
    active = count_parameters(cfg)["active"]
    dense = 6 * active * batch * T
    n_mla = len(cfg.full_attn_layers) + cfg.num_nextn_predict_layers
    mla = n_mla * 3 * T * T * cfg.num_attention_heads * (cfg.qk_head_dim + cfg.v_head_dim) * batch
    K = cfg.kda_head_dim
    kda = len(cfg.kda_layers) * 3 * T * cfg.kda_num_heads * (4 * K * K + 2 * 64 * 2 * K) * batch
    return dense + mla + kda


def bench(cfg: K3Config, backend: str, batch: int, T: int, steps: int, device: str) -> dict:
    torch.manual_seed(0)
    model = K3ForCausalLM(cfg).to(device)
    model.set_kda_backend(backend)
    opt = build_optimizer(model, lr=1e-3)
    bal = ExpertBalancer(model)
    enable_max_logit_tracking(model)
    ids = torch.randint(0, cfg.vocab_size, (1, batch * T), device=device)
    cu = torch.arange(0, batch * T + 1, T, device=device)  # `batch` documents of T tokens, packed
    amp = torch.autocast("cuda", dtype=torch.bfloat16) if device == "cuda" else torch.autocast("cpu", enabled=False)

    def step():
        with amp:
            out = model(ids, cu_seqlens=cu, labels=ids, return_logits=False)
        out["loss"].backward()
        bal.observe()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        qk_clip_(model, 100.0)
        bal.step()
        return out["loss"]

    for _ in range(3):  # warm-up: fla's autotuning, allocator
        step()
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    for _ in range(steps):
        loss = step()
    if device == "cuda":
        torch.cuda.synchronize()
    dt = (time.perf_counter() - t0) / steps
    tokens = batch * T
    return {"backend": backend, "step_s": dt, "tokens_per_s": tokens / dt,
            "mfu": flops_per_step(cfg, batch, T) / dt / PEAK, "loss": float(loss.detach()),
            "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else None}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="small")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--backends", default="fla,torch")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    cfg = K3Config.preset(args.preset)
    rows = []
    for b in args.backends.split(","):
        rows.append(bench(cfg, b, args.batch, args.seq_len, args.steps, args.device))
        print(json.dumps(rows[-1]), flush=True)
    out = {**header(), "preset": args.preset, "batch": args.batch, "seq_len": args.seq_len,
           "active_params": count_parameters(cfg)["active"], "rows": rows}
    print(f"\n{args.preset}: {args.batch} x {args.seq_len} tokens per step, active params {out['active_params'] / 1e6:.1f}M")
    print("| KDA backend | step | tokens/s | MFU | peak memory |\n|---|---|---|---|---|")
    for r in rows:
        mem = f"{r['peak_mem_gib']:.1f} GiB" if r["peak_mem_gib"] is not None else "-"
        print(f"| {r['backend']} | {r['step_s'] * 1e3:.0f} ms | {r['tokens_per_s']:,.0f} | {r['mfu']:.1%} | {mem} |")
    if len(rows) == 2:
        print(f"fla / torch tokens/s: {rows[0]['tokens_per_s'] / rows[1]['tokens_per_s']:.2f}x")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
