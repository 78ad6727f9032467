"""The training step's own kernels against what they replace or are bounded by, one op at a time: time per call over
20 calls back to back between CUDA events (the host queues ahead of the device: device time, as in a graphed step).

    python benchmarks/bench_train_kernels.py --presets small,medium --json out.json

- conv: KDA's stacked q/k/v short convolution (3 x heads x head dim channels, width 4, no activation) over one
  packed row of ``--batch`` documents of ``--seq-len`` tokens, forward + backward: k3's Triton kernels
  (``k3.ops._short_conv_triton``, what training runs) against fla-core's ``causal_conv1d`` on the same input.
  The floor: the bytes a forward and a backward must move (x, y; dy, x, dx) at ``--bandwidth`` TB/s.
- max_logit: QK-clip's per-head max logit over the same packed row (``k3.ops.max_logit``, MLA's q/k head dim)
  against the flash-attention forward over the same q, k, v (torch's varlen entry point), which computes the
  same logits and more.
- varlen: that flash-attention varlen forward + backward told the longest document (the exact maximum) against
  told the whole row's length (what a captured graph that allows any layout passes).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from benchmarks.common import cuda_time_ms, header  # noqa: E402
from k3 import K3Config  # noqa: E402


def per_call_ms(fn, calls: int = 20) -> float:
    def many():
        for _ in range(calls):
            fn()
    return cuda_time_ms(many, warmup=1, iters=5) / calls


def conv_rows(cfg: K3Config, T: int, cu: torch.Tensor, bandwidth: float, configs: list[str]) -> list[dict]:
    from fla.modules.causal_conv1d import causal_conv1d

    from k3.ops import _short_conv_triton as kernels
    from k3.ops.short_conv import _fla_tiles, _triton
    from k3.ops.varlen import document_starts

    C, W = 3 * cfg.kda_num_heads * cfg.kda_head_dim, cfg.short_conv_kernel_size
    x = torch.randn(1, T, C, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(C, 1, W, device="cuda", requires_grad=True)
    dy = torch.randn_like(x)
    document_starts(cu, "cuda")  # the plan, built once (as in training)
    tiles = _fla_tiles(cu.tolist(), T, "cuda")

    def k3_step():
        torch.autograd.grad(_triton(x, w, cu), [x, w], dy)

    def fla_step():
        y, _ = causal_conv1d(x, w.view(C, W).to(x.dtype), activation=None, cu_seqlens=cu, chunk_indices=tiles)
        torch.autograd.grad(y, [x, w], dy)

    def k3_fwd():
        with torch.no_grad():
            _triton(x, w, cu)

    def fla_fwd():
        with torch.no_grad():
            causal_conv1d(x, w.view(C, W).to(x.dtype), activation=None, cu_seqlens=cu, chunk_indices=tiles)

    y_k3 = _triton(x, w, cu)
    y_fla, _ = causal_conv1d(x, w.view(C, W).to(x.dtype), activation=None, cu_seqlens=cu, chunk_indices=tiles)
    err = ((y_k3.float() - y_fla.float()).norm() / y_fla.float().norm()).item()
    floors = {"conv fwd+bwd": 5 * T * C * 2 / (bandwidth * 1e12) * 1e3, "conv fwd": 2 * T * C * 2 / (bandwidth * 1e12) * 1e3}
    rows = []
    default = (kernels.BT, kernels.BC, kernels.WARPS)
    for conf in configs or [f"{default[0]}x{default[1]}x{default[2]}"]:  # tokens x channels x warps per program
        kernels.BT, kernels.BC, kernels.WARPS = (int(v) for v in conf.split("x"))
        for op, fn in (("conv fwd+bwd", k3_step), ("conv fwd", k3_fwd)):
            rows.append({"op": op, "impl": f"k3 Triton {conf}", "channels": C, "ms": per_call_ms(fn),
                         "floor_ms": floors[op], "rel_err_vs_fla": err})
    kernels.BT, kernels.BC, kernels.WARPS = default
    for op, fn in (("conv fwd+bwd", fla_step), ("conv fwd", fla_fwd)):
        rows.append({"op": op, "impl": "fla causal_conv1d", "channels": C, "ms": per_call_ms(fn),
                     "floor_ms": floors[op], "rel_err_vs_fla": err})
    return rows


def attention_rows(cfg: K3Config, T: int, cu: torch.Tensor, longest: int) -> list[dict]:
    from torch.nn.attention.varlen import varlen_attn

    from k3.ops.max_logit import causal_max_logit
    from k3.ops.varlen import document_starts

    H, Dk = cfg.num_attention_heads, cfg.qk_head_dim
    q, k = (torch.randn(T, H, Dk, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    v = torch.randn(T, H, Dk, device="cuda", dtype=torch.bfloat16, requires_grad=True)  # padded to Dk, as MLA
    do = torch.randn(T, H, Dk, device="cuda", dtype=torch.bfloat16)
    cu32 = cu.to(torch.int32)
    starts = document_starts(cu, "cuda")
    scale = Dk ** -0.5
    qh, kh = q.detach().transpose(0, 1)[None], k.detach().transpose(0, 1)[None]  # [1,H,T,D] views

    def fwd(max_len):
        with torch.no_grad():
            varlen_attn(q, k, v, cu32, cu32, max_len, max_len, scale=scale, window_size=(-1, 0))

    def fwd_bwd(max_len):
        o = varlen_attn(q, k, v, cu32, cu32, max_len, max_len, scale=scale, window_size=(-1, 0))
        torch.autograd.grad(o, [q, k, v], do)

    flops = 2 * H * sum((b - a) ** 2 for a, b in zip(cu.tolist(), cu.tolist()[1:])) / 2 * Dk  # QK^T, causal
    rows = [{"op": "max logit", "impl": "k3 Triton", "qk_tflops": flops,
             "ms": per_call_ms(lambda: causal_max_logit(qh, kh, scale, starts))},
            {"op": "max logit", "impl": "flash varlen forward (bound)", "qk_tflops": flops,
             "ms": per_call_ms(lambda: fwd(longest))}]
    for name, m in (("longest document", longest), ("row length", T)):
        rows.append({"op": "varlen fwd+bwd", "impl": f"max_seqlen = {name} ({m})",
                     "ms": per_call_ms(lambda m=m: fwd_bwd(m))})
    for r in rows:
        if "qk_tflops" in r:
            r["qk_tflops"] = r["qk_tflops"] / (r["ms"] / 1e3) / 1e12
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--presets", default="small,medium")
    ap.add_argument("--batch", type=int, default=8, help="documents in the packed row")
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--bandwidth", type=float, default=4.8, help="HBM TB/s for the conv's floor")
    ap.add_argument("--conv-configs", default="", help="k3's conv kernels at these tiles, e.g. 64x128x4,32x128x4 "
                    "(tokens x channels x warps per program); default: the module's")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_train_kernels.py times CUDA kernels; run it on a GPU")
    T = args.batch * args.seq_len
    cu = torch.arange(0, T + 1, args.seq_len, device="cuda")
    rows = []
    for preset in args.presets.split(","):
        cfg = K3Config.preset(preset)
        configs = [c for c in args.conv_configs.split(",") if c]
        for r in conv_rows(cfg, T, cu, args.bandwidth, configs) + attention_rows(cfg, T, cu, args.seq_len):
            r["preset"] = preset
            rows.append(r)
            print(json.dumps(r), flush=True)
    print(f"\n{args.batch} documents of {args.seq_len} tokens in one packed row")
    print("| preset | op | implementation | ms | note |")
    print("|---|---|---|---|---|")
    for r in rows:
        note = (f"floor {r['floor_ms']:.3f} ms, rel. diff to fla {r['rel_err_vs_fla']:.1e}" if "floor_ms" in r else
                f"{r['qk_tflops']:.0f} TFLOP/s of QK^T" if "qk_tflops" in r else "")
        print(f"| {r['preset']} | {r['op']} | {r['impl']} | {r['ms']:.3f} | {note} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**header(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
