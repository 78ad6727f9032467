"""KDA kernels (SPEC §2.1). The chunk kernel: our pure-torch reference vs fla-core's Triton chunk_kda, with flash
SDPA causal attention at the same shapes as the peer; forward and forward+backward, bf16 inputs, gates in (-5, 0).
The decode step (``--decode``): our one fused kernel (short convs, gate projection, norms, gate, beta, the state
step) at several V tiles, on the engine's layout (q, k, v, f_a, b slices of one projection row, states in a
strided pool), against fla-core's ``fused_recurrent_kda`` with state indices for the part it covers (norms, gate,
beta and the step, from contiguous post-conv q, k, v and a projected f: no convs, no gate projection). Each is
timed as a CUDA graph of 20 calls (kernel time without Python's launch cost).

    python benchmarks/bench_kda.py [--shapes B1-T8192-H96-D128,B8-T4096-H16-D128] [--json out.json]
    python benchmarks/bench_kda.py --decode [--decode-batches 1,8,32,64] [--heads 6] [--head-dim 128]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import cuda_time_ms, graph_time_us, header, kda_inputs  # noqa: E402
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


def bench_decode(batches, H, K, RF=None, W=4):
    """One decode step of one KDA layer: the fused kernel at each V tile, and fla-core's recurrence, per batch."""
    from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd

    from k3.ops.kda.decode import kda_decode_fused

    RF = RF or K
    HK, rows = H * K, []
    for B in batches:
        P = B + 2
        wide = torch.randn(B, 3 * HK + RF + H + HK, device="cuda", dtype=torch.bfloat16)  # q|k|v|f_a|b|gate
        q, k, v = wide[:, :HK], wide[:, HK:2 * HK], wide[:, 2 * HK:3 * HK]
        fa, b = wide[:, 3 * HK:3 * HK + RF], wide[:, 3 * HK + RF:3 * HK + RF + H]
        args = dict(conv_weights=[torch.randn(HK, 1, W, device="cuda", dtype=torch.bfloat16) for _ in range(3)],
                    A_log=torch.zeros(H, device="cuda"), dt_bias=torch.zeros(HK, device="cuda"),
                    state=torch.zeros(P, H, K, K, device="cuda"),
                    conv=torch.zeros(P, 3, HK, W - 1, device="cuda", dtype=torch.bfloat16),
                    index=torch.randperm(P, device="cuda")[:B])
        f_b = torch.randn(HK, RF, device="cuda", dtype=torch.bfloat16) * RF ** -0.5
        row = {"batch": B, "heads": H, "head_dim": K}
        for bv in (8, 16, 32, 64, 128):
            if bv <= K:
                row[f"k3_bv{bv}_us"] = graph_time_us(lambda: kda_decode_fused(
                    q, k, v, fa, b, **args, block_v=bv, f_b_weight=f_b))
        qc, kc, vc = (x.reshape(B, 1, H, K).contiguous() for x in (q, k, v))
        g, beta = torch.randn(B, 1, H, K, device="cuda", dtype=torch.bfloat16), b.reshape(B, 1, H).contiguous()
        row["fla_recurrence_us"] = graph_time_us(lambda: fused_recurrent_kda_fwd(
            q=qc, k=kc, v=vc, g=g, out=torch.empty_like(vc), beta=beta, A_log=args["A_log"], dt_bias=args["dt_bias"],
            scale=None, initial_state=args["state"], inplace_final_state=True, ssm_state_indices=args["index"],
            use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True, lower_bound=-5.0))
        rows.append(row)
        print(json.dumps(row), flush=True)
    cols = [c for c in rows[0] if c.endswith("_us")]
    print("\n| batch | " + " | ".join(c[:-3] for c in cols) + " |\n|---|" + "---|" * len(cols))
    for r in rows:
        print(f"| {r['batch']} | " + " | ".join(f"{r[c]:.1f} us" for c in cols) + " |")
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="B1-T8192-H96-D128,B8-T4096-H16-D128")
    ap.add_argument("--decode", action="store_true", help="the decode step's kernels instead of the chunk kernel")
    ap.add_argument("--decode-batches", default="1,8,32,64")
    ap.add_argument("--heads", type=int, default=6, help="--decode: KDA heads (small: 6)")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_kda needs a CUDA device")
    if args.decode:
        rows = bench_decode([int(b) for b in args.decode_batches.split(",")], args.heads, args.head_dim)
        if args.json:
            Path(args.json).write_text(json.dumps({**header(), "decode": rows}, indent=2))
        return
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
    print("\n| shape | fla fwd | fla fwd+bwd | reference fwd | reference fwd+bwd | SDPA fwd | SDPA fwd+bwd | "
          "ref/fla fwd | SDPA/fla fwd |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['shape']} | {r['fla_fwd_ms']:.2f} ms | {r['fla_fwdbwd_ms']:.2f} ms | "
              f"{r['torch_ref_fwd_ms']:.2f} ms | "
              f"{r['torch_ref_fwdbwd_ms']:.2f} ms | {r['sdpa_fwd_ms']:.2f} ms | {r['sdpa_fwdbwd_ms']:.2f} ms | "
              f"{r['torch_ref_fwd_ms'] / r['fla_fwd_ms']:.1f}x | {r['sdpa_fwd_ms'] / r['fla_fwd_ms']:.2f}x |")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
