"""Routed experts for a few tokens (decode), fused (SPEC §4).

Legend: N tokens, k experts per token, R = N*k routed rows, E experts, L latent width, I expert intermediate.
For each token n and each of its experts e_j with weight p_j:

    h_j = glu(W1[e_j] z_n, W3[e_j] z_n),   u_n = sum_j p_j W2[e_j] h_j              (fp32 out, as ExpertBank)

The grouped path (``ExpertBank.forward``: sort rows by expert, count, gather, three grouped matmuls, scatter-add)
is the reference and what training runs. For a decode step's few rows its ~15 small kernels per layer cost more
than the arithmetic, so on CUDA two Triton kernels do it straight from the routing indices: one matrix-vector
product per (row, expert) reading that expert's rows of W1/W3 with the activation fused, then one per (row, expert)
with its W2 and the routing weight fused, and a sum over each token's k rows (a fixed order: deterministic). Both
kernels spread a token's k experts over programs, so one token still fills the GPU. Products are rounded to the
weights' dtype where the grouped matmul's outputs are (before the activation, before the weighting), so the two
paths agree to summation order.
No gradient: inference only.
"""

from __future__ import annotations

import os

import torch

from ._triton import triton_available

__all__ = ["expert_decode", "decode_applies", "DECODE_ROWS"]

# most routed rows (tokens x k) for the fused path; more rows reuse each expert's weights enough for grouped GEMMs
DECODE_ROWS = int(os.environ.get("K3_MOE_DECODE_ROWS", "256"))


def decode_applies(z: torch.Tensor, idx: torch.Tensor) -> bool:
    """The fused path runs: CUDA, no gradient needed, at most DECODE_ROWS routed rows, Triton importable."""
    return z.is_cuda and not torch.is_grad_enabled() and idx.numel() <= DECODE_ROWS and triton_available()


def expert_decode(z, weights, idx, w1, w3, w2, act: str, b1: float, b2: float) -> torch.Tensor:
    """z [N,L], weights [N,k] fp32, idx [N,k]; w1, w3 [E,I,L], w2 [E,L,I] -> each routed row's weighted output
    [N,k,L] fp32 (Triton kernels; they also run under TRITON_INTERPRET=1 on CPU tensors), as a custom op opaque to
    torch.compile. The sum over a token's k rows is the caller's: inductor fuses it into the next elementwise kernel,
    or ``k3.ops.proj_decode.moe_output_decode`` does it inside the output projection (one launch less per layer
    than summing inside the op)."""
    if act not in ("situ", "silu", "swiglu"):
        raise ValueError(f"unknown activation {act!r}; expected 'situ' or 'silu'")
    return torch.ops.k3.expert_decode(z, weights, idx, w1, w3, w2, act == "situ", float(b1), float(b2))


@torch.library.custom_op("k3::expert_decode", mutates_args=())
def _expert_decode(z: torch.Tensor, weights: torch.Tensor, idx: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor,
                   w2: torch.Tensor, situ: bool, b1: float, b2: float) -> torch.Tensor:
    from ._moe_decode_triton import moe_decode_kernels

    return moe_decode_kernels(z, weights.float().contiguous(), idx.contiguous(), w1, w3, w2, situ, b1, b2)


@_expert_decode.register_fake
def _(z, weights, idx, w1, w3, w2, situ, b1, b2):
    return z.new_empty(z.shape[0], idx.shape[1], z.shape[1], dtype=torch.float32)
