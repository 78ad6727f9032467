"""Triton kernels of ``k3.ops.proj_decode`` (imported only when Triton is there). See that module for the math.

Legend: N rows, BLOCK_O outputs per program. Grid (output blocks, rows): each program recomputes its row's input
vector (a few KB, from L2) and multiplies one block of the weight's rows by it, the whole input width in one tile
(at most ``TILE`` weight elements per program: ``proj_decode_applies`` sends wider layers the unfused way).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _tanh(x):
    return 2.0 * tl.sigmoid(2.0 * x) - 1.0


@triton.jit
def _moe_out_kernel(P, GU, NW, W, OUT, L, I, Dout, stride_gu, gate_off, up_off, eps, b1, b2,
                    K_TOP: tl.constexpr, HAS_NORM: tl.constexpr, HAS_SHARED: tl.constexpr, SITU: tl.constexpr,
                    BLOCK_O: tl.constexpr, BLOCK_J: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_I: tl.constexpr):
    """Every load of a program issued at once (whole rows in registers): a step's kernels are latency-bound."""
    pid = tl.program_id(0)
    n = tl.program_id(1).to(tl.int64)
    offs_o = pid * BLOCK_O + tl.arange(0, BLOCK_O)
    mo = offs_o < Dout
    offs_l = tl.arange(0, BLOCK_L)
    ml = offs_l < L
    offs_j = tl.arange(0, BLOCK_J)
    p = tl.load(P + (n * K_TOP + offs_j[:, None]) * L + offs_l[None, :],
                mask=(offs_j[:, None] < K_TOP) & ml[None, :], other=0.0)
    u = tl.sum(p, 0)  # the sum over the token's k weighted expert rows
    if HAS_NORM:
        u = u / tl.sqrt(tl.sum(u * u, 0) / L + eps) * tl.load(NW + offs_l, mask=ml, other=0.0).to(tl.float32)
    u = u.to(OUT.dtype.element_ty).to(tl.float32)
    kin = L
    if HAS_SHARED:
        kin = L + I
    wrows = W + offs_o[:, None].to(tl.int64) * kin
    w = tl.load(wrows + offs_l[None, :], mask=mo[:, None] & ml[None, :], other=0.0).to(tl.float32)
    acc = tl.sum(w * u[None, :], 1)
    if HAS_SHARED:  # W[:, L:] . round(glu(gate, up)), the shared experts' activation
        offs_i = tl.arange(0, BLOCK_I)
        mi = offs_i < I
        g = tl.load(GU + n * stride_gu + gate_off + offs_i, mask=mi, other=0.0).to(tl.float32)
        v = tl.load(GU + n * stride_gu + up_off + offs_i, mask=mi, other=0.0).to(tl.float32)
        if SITU:
            h = b1 * _tanh(g / b1) * tl.sigmoid(g) * (b2 * _tanh(v / b2))
        else:
            h = g * tl.sigmoid(g) * v
        h = h.to(OUT.dtype.element_ty).to(tl.float32)
        w2 = tl.load(wrows + L + offs_i[None, :], mask=mo[:, None] & mi[None, :], other=0.0).to(tl.float32)
        acc += tl.sum(w2 * h[None, :], 1)
    tl.store(OUT + n * Dout + offs_o, acc.to(OUT.dtype.element_ty), mask=mo)


@triton.jit
def _kda_out_kernel(O, G, NW, W, OUT, H, K, Dout, stride_on, stride_gn, eps,
                    BLOCK_O: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr):
    """The row's heads as one [BLOCK_H, BLOCK_K] tile, the weight's block as [BLOCK_O, BLOCK_H, BLOCK_K]: every load
    issued at once."""
    pid = tl.program_id(0)
    n = tl.program_id(1).to(tl.int64)
    offs_o = pid * BLOCK_O + tl.arange(0, BLOCK_O)
    mo = offs_o < Dout
    offs_h = tl.arange(0, BLOCK_H)
    offs_k = tl.arange(0, BLOCK_K)
    mk = offs_k < K
    m2 = (offs_h[:, None] < H) & mk[None, :]
    col = offs_h[:, None] * K + offs_k[None, :]
    o = tl.load(O + n * stride_on + col, mask=m2, other=0.0).to(tl.float32)
    g = tl.load(G + n * stride_gn + col, mask=m2, other=0.0).to(tl.float32)
    nw = tl.load(NW + offs_k, mask=mk, other=0.0).to(tl.float32)
    r = 1.0 / tl.sqrt(tl.sum(o * o, 1) / K + eps)  # per head
    x = (o * r[:, None] * nw[None, :] * tl.sigmoid(g)).to(OUT.dtype.element_ty).to(tl.float32)
    w = tl.load(W + offs_o[:, None, None].to(tl.int64) * (H * K) + col[None, :, :],
                mask=mo[:, None, None] & m2[None, :, :], other=0.0).to(tl.float32)
    acc = tl.sum(tl.sum(w * x[None, :, :], 2), 1)
    tl.store(OUT + n * Dout + offs_o, acc.to(OUT.dtype.element_ty), mask=mo)


from .proj_decode import TILE, _pow2  # noqa: E402


def moe_out(parts, gu, gate_off: int, up_off: int, I: int, norm_w, eps: float, weight, situ: bool, b1: float,
            b2: float):
    """parts [N,k,L] fp32 contiguous; gu [N,*] rows at any stride (the fused input projection's output), its gate and
    up columns at gate_off / up_off (I each; I = 0: no shared experts); norm_w [L] or None; weight [Dout, L+I]
    contiguous -> [N, Dout] in weight's dtype."""
    N, k, L = parts.shape
    Dout = weight.shape[0]
    bl, bi = _pow2(L), (_pow2(I) if I else 2)
    out = torch.empty(N, Dout, dtype=weight.dtype, device=parts.device)
    block_o = max(1, min(16, TILE // (bl + (bi if I else 0))))
    _moe_out_kernel[(triton.cdiv(Dout, block_o), N)](
        parts, gu if gu is not None else parts, norm_w if norm_w is not None else parts, weight, out, L, I, Dout,
        gu.stride(0) if gu is not None else 0, gate_off, up_off, eps, b1, b2, K_TOP=k, HAS_NORM=norm_w is not None,
        HAS_SHARED=I > 0, SITU=situ, BLOCK_O=block_o, BLOCK_J=_pow2(k), BLOCK_L=bl, BLOCK_I=bi, num_warps=4)
    return out


def kda_out(o, gate, norm_w, eps: float, weight):
    """o [N,H,K] (rows at any stride, heads contiguous), gate [N,H*K] (rows at any stride), norm_w [K], weight
    [Dout, H*K] contiguous -> [N, Dout] in weight's dtype."""
    N, H, K = o.shape
    Dout = weight.shape[0]
    bh, bk = _pow2(H), _pow2(K)
    out = torch.empty(N, Dout, dtype=weight.dtype, device=o.device)
    block_o = max(1, min(16, TILE // (bh * bk)))
    _kda_out_kernel[(triton.cdiv(Dout, block_o), N)](o, gate, norm_w, weight, out, H, K, Dout, o.stride(0),
                                                      gate.stride(0), eps, BLOCK_O=block_o, BLOCK_H=bh, BLOCK_K=bk,
                                                      num_warps=4)
    return out
