"""Output projections of a decode step's few rows with the elementwise work before them fused in (SPEC §2.1, §4).

- LatentMoE's fused output projection: y_n = W_out [u_n ; h_n] with u_n = round(RMSNorm(sum_j P[n,j]) * w_u) (the
  sum over a token's k weighted expert rows, ``k3.ops.moe_decode``, then the latent norm) and h_n = round(glu(g_n,
  v_n)), the shared experts' activation over the gate and up columns of the fused input projection's output.
- KDA's output: y_n = W_o x_n with x_n[h] = round(RMSNorm(o[n,h]) * w * sigmoid(gate[n,h])), the gated per-head
  norm, then ``o_proj``.

cuBLAS runs each of these matmuls as a GEMV at one or a few rows, after one or two elementwise kernels: two or three
launches per layer, each a few microseconds at batch 1. Here one Triton kernel per layer does both: each program
recomputes its row's input vector (a few KB, from L2) and multiplies one block of the weight's rows by it. Values
are rounded where the unfused path rounds them (each input vector to the weights' dtype, the product accumulated in
fp32), so the two agree to summation order. Inference only (no gradient), and only at a few rows: each program
handles one row, so the weight is read once per row, and past ``MOE_ROWS`` / ``KDA_ROWS`` rows cuBLAS's GEMM
after the elementwise kernels is the faster path (measured on an H200, ``small``: the MoE kernel 5.0 us at one row,
13.2 us at eight, against ~6.5 us unfused; the KDA kernel 3.7 / 5.7 us against ~5.1 us; benchmarks/RESULTS.md).
"""

from __future__ import annotations

import os

import torch

from ._triton import triton_available

__all__ = ["proj_decode_applies", "moe_output_decode", "kda_output_decode", "moe_output_width", "kda_output_width",
           "MOE_ROWS", "KDA_ROWS", "TILE"]

MOE_ROWS = int(os.environ.get("K3_MOE_OUTPUT_DECODE_ROWS", "2"))
KDA_ROWS = int(os.environ.get("K3_KDA_OUTPUT_DECODE_ROWS", "8"))


TILE = 4096  # most weight elements one program holds (k3.ops._proj_decode_triton): a row's padded input width


def _pow2(x: int) -> int:
    return max(2, 1 << (x - 1).bit_length())


def moe_output_width(latent: int, shared: int) -> int:
    """The padded input width of ``moe_output_decode``'s tile."""
    return _pow2(latent) + (_pow2(shared) if shared else 0)


def kda_output_width(heads: int, head_dim: int) -> int:
    """The padded input width of ``kda_output_decode``'s tile."""
    return _pow2(heads) * _pow2(head_dim)


def proj_decode_applies(x: torch.Tensor, rows: int, max_rows: int, weight: torch.Tensor, width: int) -> bool:
    """The fused kernel runs: CUDA, no gradient, at most ``max_rows`` rows, a plain contiguous weight whose padded
    input ``width`` fits one program's tile, Triton importable."""
    return (x.is_cuda and not torch.is_grad_enabled() and rows <= max_rows and width <= TILE and weight.is_contiguous()
            and weight.dtype in (torch.bfloat16, torch.float16, torch.float32) and triton_available())


def moe_output_decode(parts: torch.Tensor, gate_up: torch.Tensor | None, gate_off: int, up_off: int, shared: int,
                      norm_weight: torch.Tensor | None, eps: float, weight: torch.Tensor, act: str, b1: float,
                      b2: float) -> torch.Tensor:
    """parts [N,k,L] fp32 (each routed row's weighted expert output); gate_up [N,*] the fused input projection's
    output, the shared experts' gate and up at columns gate_off / up_off (``shared`` wide each; 0: none);
    norm_weight [L] the latent norm's (or None); weight [Dout, L + shared] -> [N, Dout]."""
    if act not in ("situ", "silu", "swiglu"):
        raise ValueError(f"unknown activation {act!r}; expected 'situ' or 'silu'")
    return torch.ops.k3.moe_output_decode(parts, gate_up, gate_off, up_off, shared, norm_weight, float(eps), weight,
                                          act == "situ", float(b1), float(b2))


def kda_output_decode(o: torch.Tensor, gate: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                      weight: torch.Tensor) -> torch.Tensor:
    """o [N,H,K], gate [N,H*K] (rows at any stride), norm_weight [K], weight [Dout, H*K] -> [N, Dout]."""
    return torch.ops.k3.kda_output_decode(o, gate, norm_weight, float(eps), weight)


@torch.library.custom_op("k3::moe_output_decode", mutates_args=())
def _moe_output_decode(parts: torch.Tensor, gate_up: torch.Tensor | None, gate_off: int, up_off: int, shared: int,
                       norm_weight: torch.Tensor | None, eps: float, weight: torch.Tensor, situ: bool, b1: float,
                       b2: float) -> torch.Tensor:
    from ._proj_decode_triton import moe_out

    gu = gate_up if gate_up is None or gate_up.stride(-1) == 1 else gate_up.contiguous()
    return moe_out(parts.float().contiguous(), gu, gate_off, up_off, shared,
                   norm_weight.contiguous() if norm_weight is not None else None, eps, weight, situ, b1, b2)


@_moe_output_decode.register_fake
def _(parts, gate_up, gate_off, up_off, shared, norm_weight, eps, weight, situ, b1, b2):
    return parts.new_empty(parts.shape[0], weight.shape[0], dtype=weight.dtype)


@torch.library.custom_op("k3::kda_output_decode", mutates_args=())
def _kda_output_decode(o: torch.Tensor, gate: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                       weight: torch.Tensor) -> torch.Tensor:
    from ._proj_decode_triton import kda_out

    N, H, K = o.shape
    if o.stride(2) != 1 or o.stride(1) != K:
        o = o.contiguous()
    if gate.stride(-1) != 1:
        gate = gate.contiguous()
    return kda_out(o, gate, norm_weight.contiguous(), eps, weight)


@_kda_output_decode.register_fake
def _(o, gate, norm_weight, eps, weight):
    return o.new_empty(o.shape[0], weight.shape[0], dtype=weight.dtype)
