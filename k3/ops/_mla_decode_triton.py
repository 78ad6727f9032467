"""Triton kernels of ``k3.ops.mla_decode`` (imported only when Triton is there). See that module for the math.

Legend: B rows, S slices (splits) of a row's context, H heads (BLOCK_H per program), R latent (BLOCK_R padded),
Dr rope dim (BLOCK_DR padded), Tp tokens per page, BLOCK_N tokens per inner step.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _partial_kernel(Q, QPE, CACHE, PT, LEN, O, LSE,
                    stride_qb, stride_qh, stride_pb, stride_ph, stride_cp, stride_ct, stride_ptb,
                    stride_ob, stride_os, stride_oh, stride_lb, stride_ls, scale, H, LEN_OFFSET,
                    R: tl.constexpr, DR: tl.constexpr, TP: tl.constexpr, SPLITS: tl.constexpr,
                    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_DR: tl.constexpr,
                    DOT_PREC: tl.constexpr):
    b = tl.program_id(0)
    s = tl.program_id(1)
    hb = tl.program_id(2)
    n = tl.load(LEN + b).to(tl.int32) + LEN_OFFSET
    per = tl.cdiv(tl.cdiv(n, SPLITS), BLOCK_N) * BLOCK_N  # this row's slice length, whole inner steps
    start = s * per
    end = tl.minimum(start + per, n)
    offs_h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_r = tl.arange(0, BLOCK_R)
    offs_p = tl.arange(0, BLOCK_DR)
    mh, mr, mp = offs_h < H, offs_r < R, offs_p < DR
    q = tl.load(Q + b * stride_qb + offs_h[:, None] * stride_qh + offs_r[None, :], mask=mh[:, None] & mr[None, :],
                other=0.0).to(CACHE.dtype.element_ty)
    qp = tl.load(QPE + b * stride_pb + offs_h[:, None] * stride_ph + offs_p[None, :], mask=mh[:, None] & mp[None, :],
                 other=0.0).to(CACHE.dtype.element_ty)
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_R], tl.float32)
    for t0 in range(start, end, BLOCK_N):
        offs_n = t0 + tl.arange(0, BLOCK_N)
        mn = offs_n < end
        page = tl.load(PT + b * stride_ptb + offs_n // TP, mask=mn, other=0).to(tl.int64)
        row = page * stride_cp + (offs_n % TP).to(tl.int64) * stride_ct  # each token's latent, in place
        c = tl.load(CACHE + row[:, None] + offs_r[None, :], mask=mn[:, None] & mr[None, :], other=0.0)
        pe = tl.load(CACHE + row[:, None] + R + offs_p[None, :], mask=mn[:, None] & mp[None, :], other=0.0)
        sc = tl.dot(q, tl.trans(c), input_precision=DOT_PREC) + tl.dot(qp, tl.trans(pe), input_precision=DOT_PREC)
        sc = tl.where(mn[None, :], sc * scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(sc, 1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(sc - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(c.dtype), c, input_precision=DOT_PREC)
        m_i = m_new
    has = l_i > 0  # an empty slice (short row) contributes nothing: lse = -inf
    lse = tl.where(has, m_i + tl.log(tl.where(has, l_i, 1.0)), float("-inf"))
    o = acc / tl.where(has, l_i, 1.0)[:, None]
    tl.store(O + b * stride_ob + s * stride_os + offs_h[:, None] * stride_oh + offs_r[None, :], o,
             mask=mh[:, None] & mr[None, :])
    tl.store(LSE + b * stride_lb + s * stride_ls + offs_h, lse, mask=mh)


@triton.jit
def _combine_kernel(O, LSE, OUT, stride_ob, stride_os, stride_oh, stride_lb, stride_ls, stride_outb, stride_outh,
                    R: tl.constexpr, SPLITS: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_R: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_r = tl.arange(0, BLOCK_R)
    ms, mr = offs_s < SPLITS, offs_r < R
    lse = tl.load(LSE + b * stride_lb + offs_s * stride_ls + h, mask=ms, other=float("-inf"))
    m = tl.max(lse, 0)
    w = tl.where(lse > float("-inf"), tl.exp(lse - m), 0.0)
    w = w / tl.sum(w, 0)
    o = tl.load(O + b * stride_ob + offs_s[:, None] * stride_os + h * stride_oh + offs_r[None, :],
                mask=ms[:, None] & mr[None, :], other=0.0)
    tl.store(OUT + b * stride_outb + h * stride_outh + offs_r, tl.sum(w[:, None] * o, 0), mask=mr)


@triton.jit
def _write_kernel(LAT, CACHE, PT, POS, stride_lb, stride_cp, stride_ct, stride_ptb, D, TP: tl.constexpr,
                  BLOCK: tl.constexpr):
    b = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    m = offs < D
    pos = tl.load(POS + b).to(tl.int64)
    page = tl.load(PT + b * stride_ptb + pos // TP).to(tl.int64)
    x = tl.load(LAT + b * stride_lb + offs, mask=m, other=0.0)
    tl.store(CACHE + page * stride_cp + (pos % TP) * stride_ct + offs, x.to(CACHE.dtype.element_ty), mask=m)


def write_latents(latent, cache, page_table, positions) -> None:
    """cache[page_table[b, pos // Tp], pos % Tp] = latent[b] for pos = positions[b]: one program per row."""
    B, D = latent.shape
    if latent.stride(-1) != 1:
        latent = latent.contiguous()
    _write_kernel[(B,)](latent, cache, page_table, positions, latent.stride(0), cache.stride(0), cache.stride(1),
                        page_table.stride(0), D, TP=cache.shape[1], BLOCK=triton.next_power_of_2(D), num_warps=4)


def mla_decode_kernels(q_lat, q_pe, cache, page_table, lengths, length_offset, scale, splits, block_h, block_n,
                       block_r, block_dr) -> torch.Tensor:
    B, H, R = q_lat.shape
    Dr = q_pe.shape[-1]
    Tp = cache.shape[1]
    part = torch.empty(B, splits, H, R, dtype=torch.float32, device=q_lat.device)
    lse = torch.empty(B, splits, H, dtype=torch.float32, device=q_lat.device)
    out = torch.empty(B, H, R, dtype=torch.float32, device=q_lat.device)
    prec = "ieee" if cache.dtype == torch.float32 else "tf32"
    _partial_kernel[(B, splits, -(-H // block_h))](
        q_lat, q_pe, cache, page_table, lengths, part, lse,
        q_lat.stride(0), q_lat.stride(1), q_pe.stride(0), q_pe.stride(1), cache.stride(0), cache.stride(1),
        page_table.stride(0), part.stride(0), part.stride(1), part.stride(2), lse.stride(0), lse.stride(1),
        scale, H, length_offset, R=R, DR=Dr, TP=Tp, SPLITS=splits, BLOCK_H=block_h, BLOCK_N=block_n, BLOCK_R=block_r,
        BLOCK_DR=block_dr, DOT_PREC=prec, num_warps=4, num_stages=2)
    _combine_kernel[(B, H)](part, lse, out, part.stride(0), part.stride(1), part.stride(2), lse.stride(0),
                            lse.stride(1), out.stride(0), out.stride(1), R=R, SPLITS=splits,
                            BLOCK_S=max(2, triton.next_power_of_2(splits)), BLOCK_R=block_r, num_warps=4)
    return out
