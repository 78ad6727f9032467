"""Triton kernels of ``k3.ops.muon_step`` (imported only when Triton is there). See that module for the math.

Legend: a parameter's blocks seen as a strided view [N, R, C] of its storage (strides s0, s1, s2: a head block, an
expert, the transpose of a tall block); the batch slot [N, R, C] contiguous. Grid (row tiles, column tiles, N):
each program moves one [BR x BC] tile between the strided view and the slot.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _offsets(R, C, s0, s1, s2, BR: tl.constexpr, BC: tl.constexpr):
    n = tl.program_id(2).to(tl.int64)
    i = (tl.program_id(0) * BR + tl.arange(0, BR)).to(tl.int64)[:, None]
    j = (tl.program_id(1) * BC + tl.arange(0, BC)).to(tl.int64)[None, :]
    return n * s0 + i * s1 + j * s2, (n * R + i) * C + j, (i < R) & (j < C)


@triton.jit
def _momentum_kernel(G, BUF, OUT, R, C, s0, s1, s2, mu, NESTEROV: tl.constexpr, BR: tl.constexpr,
                     BC: tl.constexpr):
    src, dst, m = _offsets(R, C, s0, s1, s2, BR, BC)
    g = tl.load(G + src, mask=m, other=0.0).to(tl.float32)
    b = tl.load(BUF + src, mask=m, other=0.0).to(tl.float32)
    b = b + (1.0 - mu) * (g - b)  # lerp(buf, g, 1 - mu), torch's form for a weight below 1/2
    tl.store(BUF + src, b.to(BUF.dtype.element_ty), mask=m)
    if NESTEROV:
        u = b - (b - g) * (1.0 - mu)  # lerp(g, buf, mu), torch's form for a weight of 1/2 or more
    else:
        u = b
    tl.store(OUT + dst, u.to(OUT.dtype.element_ty), mask=m)


@triton.jit
def _update_kernel(P, O, R, C, s0, s1, s2, decay, alpha, BR: tl.constexpr, BC: tl.constexpr):
    dst_p, src_o, m = _offsets(R, C, s0, s1, s2, BR, BC)
    p = tl.load(P + dst_p, mask=m, other=0.0).to(tl.float32)
    o = tl.load(O + src_o, mask=m, other=0.0).to(tl.float32)
    tl.store(P + dst_p, (p * decay + alpha * o).to(P.dtype.element_ty), mask=m)


def _grid(view, BR, BC):
    N, R, C = view.shape
    return (triton.cdiv(R, BR), triton.cdiv(C, BC), N)


def momentum(g, buf, out, mu: float, nesterov: bool, BR: int = 64, BC: int = 64) -> None:
    N, R, C = g.shape
    _momentum_kernel[_grid(g, BR, BC)](g, buf, out, R, C, *g.stride(), float(mu), NESTEROV=bool(nesterov),
                                       BR=BR, BC=BC, num_warps=4)


def update(p, o, decay: float, alpha: float, BR: int = 64, BC: int = 64) -> None:
    N, R, C = p.shape
    _update_kernel[_grid(p, BR, BC)](p, o, R, C, *p.stride(), float(decay), float(alpha), BR=BR, BC=BC, num_warps=4)
