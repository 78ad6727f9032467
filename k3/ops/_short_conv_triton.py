"""Triton kernels of the stateless short convolution (``k3.ops.short_conv``; imported only when Triton is there).

Legend: T packed tokens, C channels, W taps, BT tokens and BC channels per program. Tap j (0 <= j < W) reads
x_{t-j} with weight w[:, W-1-j]; it exists for token t iff t - j >= start(t), the first token of t's document:
``STARTS`` [T] (packed documents) or, without it, start(t) = (t // SEG) * SEG (a batch of rows of SEG tokens).

    y[t]      = sum_j w[W-1-j] x[t-j] [t-j >= start(t)]
    dx[t]     = sum_j w[W-1-j] dy[t+j] [t >= start(t+j)]        (t + j < T)
    dw[W-1-j] = sum_t dy[t] x[t-j] [t-j >= start(t)]

Sums in fp32. The weight's gradient is summed per time tile into [tiles, W, C] fp32 (no atomics: the same result
on every run), then over the tiles by the caller.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _start(STARTS, t, mt, SEG, HAS_STARTS: tl.constexpr):
    if HAS_STARTS:
        return tl.load(STARTS + t, mask=mt, other=0).to(tl.int32)
    return (t // SEG) * SEG


@triton.jit
def _fwd_kernel(X, Wt, STARTS, Y, T, C, SEG, stride_x, stride_y,
                W: tl.constexpr, HAS_STARTS: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr):
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    c = tl.program_id(1) * BC + tl.arange(0, BC)
    mt, mc = t < T, c < C
    st = _start(STARTS, t, mt, SEG, HAS_STARTS)
    acc = tl.zeros([BT, BC], tl.float32)
    for j in tl.static_range(W):
        w = tl.load(Wt + c * W + (W - 1 - j), mask=mc, other=0.0)  # [BC] fp32
        ok = mt & (t - j >= st)
        xj = tl.load(X + (t - j).to(tl.int64)[:, None] * stride_x + c[None, :], mask=ok[:, None] & mc[None, :],
                     other=0.0)
        acc += xj.to(tl.float32) * w[None, :]
    tl.store(Y + t.to(tl.int64)[:, None] * stride_y + c[None, :], acc.to(Y.dtype.element_ty),
             mask=mt[:, None] & mc[None, :])


@triton.jit
def _bwd_kernel(X, Wt, STARTS, DY, DX, DW, T, C, SEG, stride_x, stride_dy, stride_dx,
                W: tl.constexpr, HAS_STARTS: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr):
    pt = tl.program_id(0)
    t = pt * BT + tl.arange(0, BT)
    c = tl.program_id(1) * BC + tl.arange(0, BC)
    mt, mc = t < T, c < C
    st = _start(STARTS, t, mt, SEG, HAS_STARTS)
    dy = tl.load(DY + t.to(tl.int64)[:, None] * stride_dy + c[None, :], mask=mt[:, None] & mc[None, :],
                 other=0.0).to(tl.float32)
    dx = tl.zeros([BT, BC], tl.float32)
    for j in tl.static_range(W):
        w = tl.load(Wt + c * W + (W - 1 - j), mask=mc, other=0.0)
        # dw: this tile's tokens t read x_{t-j}
        ok = mt & (t - j >= st)
        xj = tl.load(X + (t - j).to(tl.int64)[:, None] * stride_x + c[None, :], mask=ok[:, None] & mc[None, :],
                     other=0.0).to(tl.float32)
        tl.store(DW + (pt * W + (W - 1 - j)) * C + c, tl.sum(dy * xj, 0), mask=mc)
        # dx: token t is read by token s = t + j, if t is inside s's document
        s = t + j
        ms = s < T
        ss = _start(STARTS, s, ms, SEG, HAS_STARTS)
        ok = ms & (t >= ss)
        dys = tl.load(DY + s.to(tl.int64)[:, None] * stride_dy + c[None, :], mask=ok[:, None] & mc[None, :],
                      other=0.0).to(tl.float32)
        dx += dys * w[None, :]
    tl.store(DX + t.to(tl.int64)[:, None] * stride_dx + c[None, :], dx.to(DX.dtype.element_ty),
             mask=mt[:, None] & mc[None, :])


BT, BC, WARPS = 64, 128, 4  # tokens and channels per program, warps per program


def forward(x: torch.Tensor, w: torch.Tensor, starts: torch.Tensor | None, seg: int) -> torch.Tensor:
    """x [T,C] (channels contiguous), w [C,W] fp32 contiguous -> y [T,C] in x's dtype."""
    T, C = x.shape
    y = torch.empty(T, C, dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(T, BT), triton.cdiv(C, BC))
    _fwd_kernel[grid](x, w, starts if starts is not None else x, y, T, C, seg, x.stride(0), y.stride(0),
                      W=w.shape[1], HAS_STARTS=starts is not None, BT=BT, BC=BC, num_warps=WARPS)
    return y


def backward(dy: torch.Tensor, x: torch.Tensor, w: torch.Tensor, starts: torch.Tensor | None,
             seg: int) -> tuple[torch.Tensor, torch.Tensor]:
    """dy, x [T,C] (channels contiguous), w [C,W] fp32 -> (dx [T,C] in x's dtype, dw [C,W] fp32)."""
    T, C = x.shape
    W = w.shape[1]
    tiles = triton.cdiv(T, BT)
    dx = torch.empty(T, C, dtype=x.dtype, device=x.device)
    dw = torch.empty(tiles, W, C, dtype=torch.float32, device=x.device)
    _bwd_kernel[(tiles, triton.cdiv(C, BC))](x, w, starts if starts is not None else x, dy, dx, dw, T, C, seg,
                                             x.stride(0), dy.stride(0), dx.stride(0), W=W,
                                             HAS_STARTS=starts is not None, BT=BT, BC=BC, num_warps=WARPS)
    return dx, dw.sum(0).t()
