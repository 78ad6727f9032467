"""The routed experts of a training step with a memory-lean backward (SPEC §8, the report's memory-efficient MoE).

Legend: N tokens, k experts per token, M = N*k routed rows, E experts, L latent width, I expert intermediate.

    rows  = z[order // k]                      the dispatch (rows sorted by expert)
    gu    = rows W13^T per expert              gate and up, one grouped matmul        [M, 2I]
    h     = glu(gate, up)                                                            [M, I]
    out   = (w h) W2^T per expert              the routing weight on the down input   [M, L]
    y[n]  = sum_j out[inverse[n*k + j]]        the combine, fp32                      [N, L]

Autograd through these ops keeps, per layer, the dispatched rows, gate/up, h and w h for the backward (about 48 KB
per token on `medium`); recomputing the whole region in the backward keeps only z but runs both grouped matmuls
twice. ``routed_experts_recomputed`` keeps z, the routing and gu, and recomputes in the backward only what is cheap:
the dispatch (a gather), h and w h (elementwise). Its backward, by hand (dout = dy[order // k], the combine's
gradient):

    d(wh) = dout W2 per expert,   dW2 = dout^T (w h) per expert,   dw = rowsum(d(wh) h),   dh = w d(wh)
    d gate, d up = glu_backward(gate, up, dh),   d rows = d(gu) W13 per expert,   dW13 = d(gu)^T rows per expert
    dz[n] = sum_j d rows[inverse[n*k + j]]       (the dispatch's gradient; a gather, no scatter)

The same products and casts as autograd's path (``k3.layers.width.latent_moe.route_to_experts``): the same loss, and
gradients equal to rounding (tests/layers/test_latent_moe.py).
"""

from __future__ import annotations

import torch

from .grouped_mm import grouped_mm, grouped_mm_weight_grad
from .precision import upcast
from .routing import bincount, gather_sum, inverse_permutation
from .situ import glu, glu_backward

__all__ = ["routed_experts_recomputed"]


def _gate_up(w1: torch.Tensor, w3: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return torch.cat([w1.to(dtype), w3.to(dtype)], dim=1)  # [E, 2I, L]


class _RoutedExperts(torch.autograd.Function):
    @staticmethod
    def forward(ctx, z, weights, idx, w1, w3, w2, act: str, b1: float, b2: float):
        k = idx.shape[1]
        flat = idx.reshape(-1)
        order = flat.argsort(stable=True)  # slots grouped by expert
        inverse = inverse_permutation(order)
        counts = bincount(flat, w1.shape[0])
        rows = z.index_select(0, order // k)
        gu = grouped_mm(rows, _gate_up(w1, w3, rows.dtype), counts)
        h = glu(*gu.chunk(2, dim=-1), act, b1, b2)
        hw = (h * weights.reshape(-1).index_select(0, order)[:, None]).to(h.dtype)
        out = grouped_mm(hw, w2.to(hw.dtype), counts)
        ctx.save_for_backward(z, weights, gu, order, inverse, counts, w1, w3, w2)
        ctx.k, ctx.act, ctx.b1, ctx.b2 = k, act, b1, b2
        return gather_sum(out, inverse, k, torch.promote_types(out.dtype, torch.float32))

    @staticmethod
    def backward(ctx, dy):
        z, weights, gu, order, inverse, counts, w1, w3, w2 = ctx.saved_tensors
        k, act, b1, b2 = ctx.k, ctx.act, ctx.b1, ctx.b2
        dt = gu.dtype
        dout = dy.index_select(0, order // k).to(dt)  # the combine's gradient, in the rows' dtype
        rows = z.index_select(0, order // k)  # the dispatch again
        rw = weights.reshape(-1).index_select(0, order)[:, None]
        gate, up = gu.chunk(2, dim=-1)
        h = glu(gate, up, act, b1, b2)
        hw = (h * rw).to(dt)
        dhw = grouped_mm(dout, w2.to(dt).transpose(1, 2), counts)  # dout W2 per expert: [M, I]
        dw2 = grouped_mm_weight_grad(dout, hw, counts)  # [E, L, I]
        dprod = upcast(dhw)  # the weighting ran in fp32 (h times the fp32 weight), then was rounded
        drw = (dprod * upcast(h)).sum(-1)
        dgate, dup = glu_backward(gate, up, (dprod * rw).to(dt), act, b1, b2)
        dgu = torch.cat([dgate, dup], dim=-1)
        drows = grouped_mm(dgu, _gate_up(w1, w3, dt).transpose(1, 2), counts)  # [M, L]
        dw1, dw3 = grouped_mm_weight_grad(dgu, rows, counts).chunk(2, dim=1)  # [E, I, L] each
        dz = gather_sum(drows, inverse, k, drows.dtype)
        dweights = drw.index_select(0, inverse).view_as(weights).to(weights.dtype)  # weights.flat[order]'s gradient
        return dz, dweights, None, dw1.to(w1.dtype), dw3.to(w3.dtype), dw2.to(w2.dtype), None, None, None


def routed_experts_recomputed(z: torch.Tensor, weights: torch.Tensor, idx: torch.Tensor, w1: torch.Tensor,
                              w3: torch.Tensor, w2: torch.Tensor, act: str, b1: float, b2: float) -> torch.Tensor:
    """z [N,L], weights [N,k] fp32, idx [N,k], w1/w3 [E,I,L], w2 [E,L,I] -> sum_j w_j E_j(z) [N,L] fp32, keeping for
    the backward only z, the routing and the gate/up product (see the module docstring)."""
    return _RoutedExperts.apply(z, weights, idx, w1, w3, w2, act, b1, b2)
