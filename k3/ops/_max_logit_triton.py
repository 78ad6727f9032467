"""Triton kernel of ``k3.ops.max_logit`` (imported only when Triton is there). See that module for the math.

Legend: B rows, H heads, T positions, D head dim (BLOCK_D padded), BLOCK_M queries per program, BLOCK_N keys per
inner step.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _tile_max(q, K, kbase, n0, offs_d, md, T, scale, offs_m, st, mm, best, MASKED: tl.constexpr,
              BLOCK_N: tl.constexpr, stride_kt, DOT_PREC: tl.constexpr):
    offs_n = n0 + tl.arange(0, BLOCK_N)
    mn = offs_n < T
    kk = tl.load(kbase + offs_n[:, None].to(tl.int64) * stride_kt + offs_d[None, :], mask=mn[:, None] & md[None, :],
                 other=0.0)
    s = tl.dot(q, tl.trans(kk), input_precision=DOT_PREC) * scale  # [BLOCK_M, BLOCK_N] fp32
    if MASKED:
        vis = (offs_n[None, :] <= offs_m[:, None]) & (offs_n[None, :] >= st[:, None]) & mm[:, None] & mn[None, :]
        s = tl.where(vis, s, float("-inf"))
    return tl.maximum(best, tl.max(s, 1))


@triton.jit
def _max_logit_kernel(Q, K, STARTS, OUT, T, scale,
                      stride_qb, stride_qh, stride_qt, stride_kb, stride_kh, stride_kt, stride_ob, stride_oh,
                      D: tl.constexpr, HAS_STARTS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_D: tl.constexpr, DOT_PREC: tl.constexpr):
    """Key tiles [lo, F0) and [F1, hi) are masked (a document start or the diagonal inside them); those in
    [F0, F1) are seen whole by every query of the block (at or after every query's start, before its first query),
    so their maximum needs no mask."""
    mb = tl.program_id(0)
    h = tl.program_id(1)
    b = tl.program_id(2)
    offs_m = mb * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    mm, md = offs_m < T, offs_d < D
    if HAS_STARTS:
        st = tl.load(STARTS + offs_m, mask=mm, other=0).to(tl.int32)
    else:
        st = tl.zeros([BLOCK_M], tl.int32)
    lo = tl.min(tl.where(mm, st, T), 0)  # the earliest key any of these queries sees
    lo = (lo // BLOCK_N) * BLOCK_N
    hi = tl.minimum(mb * BLOCK_M + BLOCK_M, T)
    f0 = tl.maximum((tl.max(st, 0) + BLOCK_N - 1) // BLOCK_N * BLOCK_N, lo)
    f1 = tl.maximum(mb * BLOCK_M, f0)
    q = tl.load(Q + b * stride_qb + h * stride_qh + offs_m[:, None].to(tl.int64) * stride_qt + offs_d[None, :],
                mask=mm[:, None] & md[None, :], other=0.0)
    kbase = K + b * stride_kb + h * stride_kh
    best = tl.full([BLOCK_M], float("-inf"), tl.float32)
    for n0 in range(lo, tl.minimum(f0, hi), BLOCK_N):
        best = _tile_max(q, K, kbase, n0, offs_d, md, T, scale, offs_m, st, mm, best, True, BLOCK_N, stride_kt,
                         DOT_PREC)
    for n0 in range(f0, f1, BLOCK_N):
        best = _tile_max(q, K, kbase, n0, offs_d, md, T, scale, offs_m, st, mm, best, False, BLOCK_N, stride_kt,
                         DOT_PREC)
    for n0 in range(f1, hi, BLOCK_N):
        best = _tile_max(q, K, kbase, n0, offs_d, md, T, scale, offs_m, st, mm, best, True, BLOCK_N, stride_kt,
                         DOT_PREC)
    best = tl.where(mm, best, float("-inf"))
    tl.store(OUT + b * stride_ob + h * stride_oh + mb, tl.max(best, 0))


def launch(q: torch.Tensor, k: torch.Tensor, scale: float, starts: torch.Tensor | None) -> torch.Tensor:
    """q, k [B,H,T,D] (the last dim contiguous), starts [T] int or None -> [H] fp32."""
    B, H, T, D = q.shape
    if q.stride(-1) != 1:
        q = q.contiguous()
    if k.stride(-1) != 1:
        k = k.contiguous()
    block_m, block_n = 128, 64
    nb = triton.cdiv(T, block_m)
    out = torch.empty(B, H, nb, dtype=torch.float32, device=q.device)
    prec = "ieee" if q.dtype == torch.float32 else "tf32"  # bf16/fp16 operands: tensor cores, fp32 accumulation
    _max_logit_kernel[(nb, H, B)](
        q, k, starts if starts is not None else out, out, T, scale, q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2), out.stride(0), out.stride(1), D=D, HAS_STARTS=starts is not None,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=max(16, triton.next_power_of_2(D)), DOT_PREC=prec,
        num_warps=8, num_stages=3)
    return out.amax(dim=(0, 2))
