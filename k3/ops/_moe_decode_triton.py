"""Triton kernels of ``k3.ops.moe_decode`` (imported only when Triton is there). See that module for the math.

Legend: N tokens, k experts per token, L latent width (BLOCK_L per step), I expert intermediate (BLOCK_I).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _tanh(x):
    return 2.0 * tl.sigmoid(2.0 * x) - 1.0


@triton.jit
def _up_kernel(Z, IDX, W1, W3, H, L, I, stride_zn, stride_we, B1, B2, K_TOP: tl.constexpr, SITU: tl.constexpr,
               BLOCK_I: tl.constexpr, BLOCK_L: tl.constexpr):
    r = tl.program_id(0)  # routed row: token r // K_TOP, its (r % K_TOP)-th expert
    offs_i = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
    mi = offs_i < I
    e = tl.load(IDX + r).to(tl.int64)
    n = r // K_TOP
    acc1 = tl.zeros([BLOCK_I], tl.float32)
    acc3 = tl.zeros([BLOCK_I], tl.float32)
    for l0 in range(0, L, BLOCK_L):
        offs_l = l0 + tl.arange(0, BLOCK_L)
        ml = offs_l < L
        z = tl.load(Z + n * stride_zn + offs_l, mask=ml, other=0.0).to(tl.float32)  # z's rows may be strided
        rows = e * stride_we + offs_i[:, None] * L + offs_l[None, :]
        m2 = mi[:, None] & ml[None, :]
        acc1 += tl.sum(tl.load(W1 + rows, mask=m2, other=0.0).to(tl.float32) * z[None, :], 1)
        acc3 += tl.sum(tl.load(W3 + rows, mask=m2, other=0.0).to(tl.float32) * z[None, :], 1)
    g = acc1.to(H.dtype.element_ty).to(tl.float32)  # rounded as the grouped matmul's outputs are
    u = acc3.to(H.dtype.element_ty).to(tl.float32)
    if SITU:
        h = B1 * _tanh(g / B1) * tl.sigmoid(g) * (B2 * _tanh(u / B2))
    else:
        h = g * tl.sigmoid(g) * u
    tl.store(H + r * I + offs_i, h.to(H.dtype.element_ty), mask=mi)


@triton.jit
def _down_kernel(H, IDX, WT, W2, P, L, I, stride_we, BLOCK_L: tl.constexpr, BLOCK_I: tl.constexpr):
    """One (routed row, block of L) per program: P[r] = p_r * round(W2[e_r] h_r); the k rows of a token are summed
    after (in a fixed order: deterministic, unlike atomics)."""
    r = tl.program_id(0)
    offs_l = tl.program_id(1) * BLOCK_L + tl.arange(0, BLOCK_L)
    ml = offs_l < L
    e = tl.load(IDX + r).to(tl.int64)
    part = tl.zeros([BLOCK_L], tl.float32)
    for i0 in range(0, I, BLOCK_I):
        offs_i = i0 + tl.arange(0, BLOCK_I)
        mi = offs_i < I
        h = tl.load(H + r * I + offs_i, mask=mi, other=0.0).to(tl.float32)
        w = tl.load(W2 + e * stride_we + offs_l[:, None] * I + offs_i[None, :], mask=ml[:, None] & mi[None, :],
                    other=0.0).to(tl.float32)
        part += tl.sum(w * h[None, :], 1)
    p = tl.load(WT + r)
    tl.store(P + r * L + offs_l, part.to(H.dtype.element_ty).to(tl.float32) * p, mask=ml)  # rounded as the
    # grouped matmul's outputs are


def moe_decode_kernels(z, weights, idx, w1, w3, w2, situ: bool, b1: float, b2: float) -> torch.Tensor:
    """z [N,L] (rows at any stride: the engine's is a column slice of the fused projection), weights [N,k] fp32,
    idx [N,k] contiguous -> each routed row's weighted output [N,k,L] fp32."""
    N, L = z.shape
    if z.stride(1) != 1:
        z = z.contiguous()
    k = idx.shape[1]
    E, I, _ = w1.shape
    # the kernels index each expert's matrix as dense rows ([I,L] for w1/w3, [L,I] for w2), w1 and w3 by one stride
    w1, w3, w2 = (w if w.stride()[1:] == (w.shape[2], 1) else w.contiguous() for w in (w1, w3, w2))
    if w3.stride(0) != w1.stride(0):
        w1, w3 = w1.contiguous(), w3.contiguous()
    dtype = w1.dtype if w1.dtype in (torch.bfloat16, torch.float16) else z.dtype
    h = torch.empty(N * k, I, dtype=dtype, device=z.device)
    part = torch.empty(N * k, L, dtype=torch.float32, device=z.device)
    block_i, block_l = 16, min(128, triton.next_power_of_2(L))  # small blocks: enough programs at one token
    _up_kernel[(N * k, triton.cdiv(I, block_i))](z, idx, w1, w3, h, L, I, z.stride(0), w1.stride(0), b1, b2, K_TOP=k,
                                                 SITU=situ, BLOCK_I=block_i, BLOCK_L=block_l, num_warps=4)
    block_l2, block_i2 = 8, min(128, triton.next_power_of_2(I))  # one program per (routed row, 8 outputs)
    _down_kernel[(N * k, triton.cdiv(L, block_l2))](h, idx, weights, w2, part, L, I, w2.stride(0), BLOCK_L=block_l2,
                                                     BLOCK_I=block_i2, num_warps=4)
    return part.view(N, k, L)  # the caller sums over k (in its compiled graph)
