"""AttnRes's mix + pre-norm kernels (SPEC §3, ``k3.ops.attn_res``) on one GPU, bf16, each against the compiled
reference at the same shapes:
- training (``--sections train``): the Triton forward and backward of ``attn_res_mix_norm_triton`` at a training
  step's rows (8 x 4096 tokens), the backward's second kernel at several tile shapes (rows, D, warps), its first
  kernel at several (rows, D), and the bytes
  the backward must move (every source read twice, dy read, every gradient written) against the device's bandwidth;
- inference (``--sections rows``): the one-program-per-row kernel (``k3::attn_res_rows``, the add of the sub-layer
  before inside it) against ``torch.compile`` of the add + reference mix, at decode batch sizes, each timed as a
  CUDA graph of 20 calls (kernel time without Python's launch cost).

    python benchmarks/bench_attn_res.py [--sections train,rows] [--widths 768,2048] [--sources 3,5] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import cuda_time_ms, graph_time_us, header  # noqa: E402
from k3.ops import _attn_res_triton as kernels  # noqa: E402
from k3.ops.attn_res import attn_res_mix_norm_reference, attn_res_mix_norm_triton  # noqa: E402

COLS = [(8, 256, 4), (32, 128, 4), (64, 128, 8), (32, 64, 4), (64, 64, 4), (128, 64, 8), (32, 128, 2)]


def inputs(S, N, D, grad=False):
    g = torch.Generator(device="cuda").manual_seed(0)
    sources = [torch.randn(N, D, device="cuda", generator=g).to(torch.bfloat16).requires_grad_(grad) for _ in range(S)]
    q = (torch.randn(D, device="cuda", generator=g) / D ** 0.5).requires_grad_(grad)
    kn = torch.ones(D, device="cuda").requires_grad_(grad)
    nw = torch.ones(D, device="cuda").requires_grad_(grad)
    return sources, q, kn, nw


def train_rows(S, N, D, hbm):
    sources, q, kn, nw = inputs(S, N, D, grad=True)
    dy = torch.randn(N, D, device="cuda", dtype=torch.bfloat16)
    params = [*sources, q, kn, nw]
    ref = torch.compile(attn_res_mix_norm_reference)

    def fwd_bwd(fn):
        y = fn(sources, q, kn, 1e-5, nw, 1e-5)
        torch.autograd.grad(y, params, dy)

    out = {"S": S, "N": N, "D": D,
           "triton_fwd_ms": cuda_time_ms(lambda: attn_res_mix_norm_triton(sources, q, kn, 1e-5, nw, 1e-5)),
           "triton_fwd_bwd_ms": cuda_time_ms(lambda: fwd_bwd(attn_res_mix_norm_triton)),
           "compiled_ref_fwd_bwd_ms": cuda_time_ms(lambda: fwd_bwd(ref))}
    flat = [s.detach() for s in sources]
    u = (q * kn).detach().float()
    _, stats, r2 = kernels.forward(flat, u, nw.detach(), 1e-5, 1e-5)
    bwd_bytes = (3 * S + 1) * N * D * 2  # sources twice (h recomputed, then each dv) + dy in, every dv out
    cols = {}
    for c in COLS:
        ms = cuda_time_ms(lambda: kernels.backward(dy, flat, u, nw.detach(), stats, r2, cols=c), iters=10)
        cols["x".join(map(str, c))] = {"ms": ms, "of_hbm": bwd_bytes / (ms * 1e-3) / hbm}
        print(f"  S={S} N={N} D={D} backward with cols tile {c}: {ms:.3f} ms "
              f"({bwd_bytes / (ms * 1e-3) / 1e12:.2f} TB/s, {cols['x'.join(map(str, c))]['of_hbm']:.0%})", flush=True)
    out["backward_by_cols_tile"] = cols
    rows = {}  # the first kernel (per-row logit gradients: reads every source twice and dy) at its tile shapes
    for bn, bd in ((8, 256), (16, 256), (32, 128), (32, 64)):
        ms = cuda_time_ms(lambda: kernels.backward(dy, flat, u, nw.detach(), stats, r2, block_n=bn, block_d=bd),
                          iters=10)
        rows[f"{bn}x{bd}"] = ms
        print(f"  S={S} N={N} D={D} backward with rows tile ({bn}, {bd}): {ms:.3f} ms", flush=True)
    out["backward_by_rows_tile"] = rows
    print(f"  S={S} N={N} D={D}: triton fwd {out['triton_fwd_ms']:.3f} ms, fwd+bwd {out['triton_fwd_bwd_ms']:.3f} ms; "
          f"compiled reference fwd+bwd {out['compiled_ref_fwd_bwd_ms']:.3f} ms", flush=True)
    return out


def decode_rows(S, B, D):
    sources, q, kn, nw = inputs(S, B, D)
    delta = torch.randn_like(sources[-1])

    def add_then_mix(sources, delta, q, kn, nw):
        last = sources[-1] + delta
        return attn_res_mix_norm_reference(sources[:-1] + [last], q, kn, 1e-5, nw, 1e-5), last

    ref = torch.compile(add_then_mix)
    with torch.no_grad():
        comp = graph_time_us(lambda: ref(sources, delta, q, kn, nw))
        kern = {}
        for w in (1, 2, 4):
            kern[w] = graph_time_us(lambda: kernels.rows(sources, delta, q, kn, nw, 1e-5, 1e-5, num_warps=w))
    best = min(kern, key=kern.get)
    print(f"  S={S} B={B} D={D}: row kernel " + ", ".join(f"{v:.1f} us ({w} warps)" for w, v in kern.items())
          + f"; compiled add + reference {comp:.1f} us ({comp / kern[best]:.2f}x the best)", flush=True)
    return {"S": S, "B": B, "D": D, "row_kernel_us_by_warps": kern, "compiled_reference_us": comp}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sections", default="train,rows")
    ap.add_argument("--widths", default="768,2048")
    ap.add_argument("--sources", default="3,5")
    ap.add_argument("--rows", type=int, default=32768, help="training rows (tokens per step)")
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--hbm-tb-s", type=float, default=4.3, help="the bandwidth the fractions are of (bench_decode's 4.3 TB/s)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_attn_res.py times Triton kernels: it needs a CUDA device")
    sections = args.sections.split(",")
    res = {**header(), "train": [], "rows": []}
    for D in map(int, args.widths.split(",")):
        for S in map(int, args.sources.split(",")):
            if "train" in sections:
                res["train"].append(train_rows(S, args.rows, D, args.hbm_tb_s * 1e12))
            if "rows" in sections:
                for B in map(int, args.batches.split(",")):
                    res["rows"].append(decode_rows(S, B, D))
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2) + "\n")


if __name__ == "__main__":
    main()
