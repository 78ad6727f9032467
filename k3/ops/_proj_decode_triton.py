"""Triton kernels of ``k3.ops.proj_decode`` (imported only when Triton is there). See that module for the math.

Legend: N rows, BLOCK_O outputs per program, BLOCK_K input columns per step. Grid (output blocks, rows): each
program recomputes its row's prologue (cheap: a few KB) and multiplies one block of the weight's rows by it.
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
                    BLOCK_O: tl.constexpr, BLOCK_K: tl.constexpr):
    pid = tl.program_id(0)
    n = tl.program_id(1).to(tl.int64)
    offs_o = pid * BLOCK_O + tl.arange(0, BLOCK_O)
    mo = offs_o < Dout
    kin = L
    if HAS_SHARED:
        kin = L + I
    wrows = W + offs_o[:, None].to(tl.int64) * kin
    r = 1.0
    if HAS_NORM:  # the latent norm's inverse RMS over u = sum_j P[n, j]
        ss = tl.zeros([BLOCK_K], tl.float32)
        for l0 in range(0, L, BLOCK_K):
            offs = l0 + tl.arange(0, BLOCK_K)
            m = offs < L
            u = tl.zeros([BLOCK_K], tl.float32)
            for j in tl.static_range(K_TOP):
                u += tl.load(P + (n * K_TOP + j) * L + offs, mask=m, other=0.0)
            ss += u * u
        r = 1.0 / tl.sqrt(tl.sum(ss, 0) / L + eps)
    acc = tl.zeros([BLOCK_O], tl.float32)
    for l0 in range(0, L, BLOCK_K):  # W[:, :L] . round(u r w)
        offs = l0 + tl.arange(0, BLOCK_K)
        m = offs < L
        u = tl.zeros([BLOCK_K], tl.float32)
        for j in tl.static_range(K_TOP):
            u += tl.load(P + (n * K_TOP + j) * L + offs, mask=m, other=0.0)
        if HAS_NORM:
            u = u * r * tl.load(NW + offs, mask=m, other=0.0).to(tl.float32)
        u = u.to(OUT.dtype.element_ty).to(tl.float32)
        w = tl.load(wrows + offs[None, :], mask=mo[:, None] & m[None, :], other=0.0).to(tl.float32)
        acc += tl.sum(w * u[None, :], 1)
    if HAS_SHARED:  # W[:, L:] . round(glu(gate, up)), the shared experts' activation
        for i0 in range(0, I, BLOCK_K):
            offs = i0 + tl.arange(0, BLOCK_K)
            m = offs < I
            g = tl.load(GU + n * stride_gu + gate_off + offs, mask=m, other=0.0).to(tl.float32)
            v = tl.load(GU + n * stride_gu + up_off + offs, mask=m, other=0.0).to(tl.float32)
            if SITU:
                h = b1 * _tanh(g / b1) * tl.sigmoid(g) * (b2 * _tanh(v / b2))
            else:
                h = g * tl.sigmoid(g) * v
            h = h.to(OUT.dtype.element_ty).to(tl.float32)
            w = tl.load(wrows + L + offs[None, :], mask=mo[:, None] & m[None, :], other=0.0).to(tl.float32)
            acc += tl.sum(w * h[None, :], 1)
    tl.store(OUT + n * Dout + offs_o, acc.to(OUT.dtype.element_ty), mask=mo)


@triton.jit
def _kda_out_kernel(O, G, NW, W, OUT, H, K, Dout, stride_on, stride_gn, eps,
                    BLOCK_O: tl.constexpr, BLOCK_K: tl.constexpr):
    pid = tl.program_id(0)
    n = tl.program_id(1).to(tl.int64)
    offs_o = pid * BLOCK_O + tl.arange(0, BLOCK_O)
    mo = offs_o < Dout
    offs_k = tl.arange(0, BLOCK_K)
    mk = offs_k < K
    nw = tl.load(NW + offs_k, mask=mk, other=0.0).to(tl.float32)
    wrows = W + offs_o[:, None].to(tl.int64) * (H * K)
    acc = tl.zeros([BLOCK_O], tl.float32)
    for h in range(H):  # per head: round(RMSNorm(o_h) w sigmoid(gate_h)), then its K columns of W
        o = tl.load(O + n * stride_on + h * K + offs_k, mask=mk, other=0.0).to(tl.float32)
        r = 1.0 / tl.sqrt(tl.sum(o * o, 0) / K + eps)
        g = tl.load(G + n * stride_gn + h * K + offs_k, mask=mk, other=0.0).to(tl.float32)
        x = (o * r * nw * tl.sigmoid(g)).to(OUT.dtype.element_ty).to(tl.float32)
        w = tl.load(wrows + h * K + offs_k[None, :], mask=mo[:, None] & mk[None, :], other=0.0).to(tl.float32)
        acc += tl.sum(w * x[None, :], 1)
    tl.store(OUT + n * Dout + offs_o, acc.to(OUT.dtype.element_ty), mask=mo)


def moe_out(parts, gu, gate_off: int, up_off: int, I: int, norm_w, eps: float, weight, situ: bool, b1: float,
            b2: float, block_o: int = 4, block_k: int = 256):
    """parts [N,k,L] fp32 contiguous; gu [N,*] rows at any stride (the fused input projection's output), its gate and
    up columns at gate_off / up_off (I each; I = 0: no shared experts); norm_w [L] or None; weight [Dout, L+I]
    contiguous -> [N, Dout] in weight's dtype."""
    N, k, L = parts.shape
    Dout = weight.shape[0]
    out = torch.empty(N, Dout, dtype=weight.dtype, device=parts.device)
    _moe_out_kernel[(triton.cdiv(Dout, block_o), N)](
        parts, gu if gu is not None else parts, norm_w if norm_w is not None else parts, weight, out, L, I, Dout,
        gu.stride(0) if gu is not None else 0, gate_off, up_off, eps, b1, b2, K_TOP=k, HAS_NORM=norm_w is not None,
        HAS_SHARED=I > 0, SITU=situ, BLOCK_O=block_o, BLOCK_K=block_k, num_warps=2)
    return out


def kda_out(o, gate, norm_w, eps: float, weight, block_o: int = 4):
    """o [N,H,K] (rows at any stride, heads contiguous), gate [N,H*K] (rows at any stride), norm_w [K], weight
    [Dout, H*K] contiguous -> [N, Dout] in weight's dtype."""
    N, H, K = o.shape
    Dout = weight.shape[0]
    out = torch.empty(N, Dout, dtype=weight.dtype, device=o.device)
    _kda_out_kernel[(triton.cdiv(Dout, block_o), N)](o, gate, norm_w, weight, out, H, K, Dout, o.stride(0),
                                                      gate.stride(0), eps, BLOCK_O=block_o,
                                                      BLOCK_K=max(16, triton.next_power_of_2(K)), num_warps=2)
    return out
