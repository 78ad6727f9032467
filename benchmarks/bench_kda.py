"""KDA chunk kernel: our pure-torch reference vs fla-core's Triton chunk_kda, with flash SDPA causal attention
at the same shapes as the peer (SPEC §2.1). Forward and forward+backward, bf16 inputs, gates in (-5, 0).

    python benchmarks/bench_kda.py [--shapes B1-T8192-H96-D128,B8-T4096-H16-D128] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import cuda_time_ms, header, kda_inputs  # noqa: E402
from k3.ops.kda import chunk_kda  # noqa: E402


def parse(shape: str):
    d = dict((p[0], int(p[1:])) for p in shape.split("-"))
    return d["B"], d["T"], d["H"], d["D"]


def bench_kda(backend, B, T, H, D):
    xs = kda_inputs(B, T, H, D, requires_grad=True)
    do = torch.randn(B, T, H, D, device="cuda", dtype=torch.bfloat16)

    def fwd():
        with torch.no_grad():
            chunk_kda(*xs, lower_bound=-5.0, backend=backend)

    def fwd_bwd():
        o, _ = chunk_kda(*xs, lower_bound=-5.0, backend=backend)
        o.backward(do)

    try:
        return cuda_time_ms(fwd), cuda_time_ms(fwd_bwd, warmup=2, iters=5)
    except torch.OutOfMemoryError:
        return float("nan"), float("nan")
    finally:
        torch.cuda.empty_cache()


def bench_sdpa(B, T, H, D):
    q, k, v = (torch.randn(B, H, T, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    do = torch.randn_like(q)

    def fwd():
        with torch.no_grad():
            F.scaled_dot_product_attention(q, k, v, is_causal=True)

    def fwd_bwd():
        F.scaled_dot_product_attention(q, k, v, is_causal=True).backward(do)

    return cuda_time_ms(fwd), cuda_time_ms(fwd_bwd)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="B1-T8192-H96-D128,B8-T4096-H16-D128")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_kda needs a CUDA device")
    # fla autotunes on first use per (H, K): cuda_time_ms's warm-up calls absorb it, outside the timed loop
    rows = []
    for s in args.shapes.split(","):
        B, T, H, D = parse(s)
        fla_f, fla_fb = bench_kda("fla", B, T, H, D)
        ref_f, ref_fb = bench_kda("torch", B, T, H, D)
        sd_f, sd_fb = bench_sdpa(B, T, H, D)
        rows.append({"shape": s, "fla_fwd_ms": fla_f, "fla_fwdbwd_ms": fla_fb, "torch_ref_fwd_ms": ref_f,
                     "torch_ref_fwdbwd_ms": ref_fb, "sdpa_fwd_ms": sd_f, "sdpa_fwdbwd_ms": sd_fb})
        print(json.dumps(rows[-1]), flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps({**header(), "rows": rows}, indent=2))
    out = {**header(), "rows": rows}
    print(json.dumps(out, indent=2))
    print("\n| shape | fla fwd | fla fwd+bwd | reference fwd | reference fwd+bwd | SDPA fwd | SDPA fwd+bwd | ref/fla fwd | SDPA/fla fwd |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['shape']} | {r['fla_fwd_ms']:.2f} ms | {r['fla_fwdbwd_ms']:.2f} ms | {r['torch_ref_fwd_ms']:.2f} ms | "
              f"{r['torch_ref_fwdbwd_ms']:.2f} ms | {r['sdpa_fwd_ms']:.2f} ms | {r['sdpa_fwdbwd_ms']:.2f} ms | "
              f"{r['torch_ref_fwd_ms'] / r['fla_fwd_ms']:.1f}x | {r['sdpa_fwd_ms'] / r['fla_fwd_ms']:.2f}x |")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
