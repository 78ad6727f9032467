"""Triton kernels of ``k3.ops.muon_step`` (imported only when Triton is there). See that module for the math.

Legend: P tensors of one bucket; each a strided view [N, R, C] of its storage (strides s0, s1, s2: a head block, an
expert, the transpose of a tall block) with a contiguous slot [N, R, C] in the Newton-Schulz batch. One launch per
memory order in the bucket (ORDER: 0 = C contiguous, s2 = 1; 1 = R contiguous, s1 = 1, a tall block seen
transposed; 2 = neither), so the compiler knows which axis is contiguous and reads and writes both sides in
coalesced vectors (with runtime strides alone every element is its own load). grid = every [BR x BC] tile of every
tensor of that order; a program finds its tensor by binary search over the tensors' first tiles (TS), reads the
tensor's addresses, shape and strides from a table (TAB, int64 [P, 8]) and its scalars from another (FTAB, fp32
[P, 2]).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_TL = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


@triton.jit
def _tile(TAB, TS, P, BR: tl.constexpr, BC: tl.constexpr, LOG_P: tl.constexpr, ORDER: tl.constexpr):
    """-> (tensor index, its table row, element offsets in the strided view, offsets in the slot, mask)."""
    pid = tl.program_id(0).to(tl.int64)
    lo = pid * 0
    hi = lo + P
    for _ in tl.static_range(LOG_P):  # TS[lo] <= pid < TS[hi]
        mid = (lo + hi) // 2
        go = tl.load(TS + mid) <= pid
        lo = tl.where(go, mid, lo)
        hi = tl.where(go, hi, mid)
    row = TAB + lo * 8
    R, C = tl.load(row + 3), tl.load(row + 4)
    s0, s1, s2 = tl.load(row + 5), tl.load(row + 6), tl.load(row + 7)
    tr, tc = tl.cdiv(R, BR), tl.cdiv(C, BC)
    t = pid - tl.load(TS + lo)
    n, rem = t // (tr * tc), t % (tr * tc)
    i = ((rem // tc) * BR + tl.arange(0, BR))[:, None]
    j = ((rem % tc) * BC + tl.arange(0, BC))[None, :]
    if ORDER == 0:
        src = n * s0 + i * s1 + j
    elif ORDER == 1:
        src = n * s0 + i + j * s2
    else:
        src = n * s0 + i * s1 + j * s2
    return lo, row, src, (n * R + i) * C + j, (i < R) & (j < C)


@triton.jit
def _momentum_kernel(TAB, FTAB, TS, P, SCALE, T_DTYPE: tl.constexpr, S_DTYPE: tl.constexpr, BR: tl.constexpr,
                     BC: tl.constexpr, LOG_P: tl.constexpr, ORDER: tl.constexpr, HAS_SCALE: tl.constexpr):
    k, row, src, dst, m = _tile(TAB, TS, P, BR, BC, LOG_P, ORDER)
    G = tl.load(row).to(tl.pointer_type(T_DTYPE))
    BUF = tl.load(row + 1).to(tl.pointer_type(T_DTYPE))
    OUT = tl.load(row + 2).to(tl.pointer_type(S_DTYPE))
    mu, nesterov = tl.load(FTAB + k * 2), tl.load(FTAB + k * 2 + 1)
    g = tl.load(G + src, mask=m, other=0.0).to(tl.float32)
    if HAS_SCALE:  # gradient clipping's coefficient, a device scalar (no pass of its own over the gradients)
        g = g * tl.load(SCALE).to(tl.float32)
    b = tl.load(BUF + src, mask=m, other=0.0).to(tl.float32)
    b = b + (1.0 - mu) * (g - b)  # lerp(buf, g, 1 - mu), torch's form for a weight below 1/2
    tl.store(BUF + src, b.to(T_DTYPE), mask=m)
    u = tl.where(nesterov != 0.0, b - (b - g) * (1.0 - mu), b)  # lerp(g, buf, mu): torch's form for weights >= 1/2
    tl.store(OUT + dst, u.to(S_DTYPE), mask=m)


@triton.jit
def _update_kernel(TAB, FTAB, TS, P, T_DTYPE: tl.constexpr, S_DTYPE: tl.constexpr, BR: tl.constexpr,
                   BC: tl.constexpr, LOG_P: tl.constexpr, ORDER: tl.constexpr):
    k, row, dst_p, src_o, m = _tile(TAB, TS, P, BR, BC, LOG_P, ORDER)
    W = tl.load(row).to(tl.pointer_type(T_DTYPE))
    O = tl.load(row + 2).to(tl.pointer_type(S_DTYPE))
    decay, alpha = tl.load(FTAB + k * 2), tl.load(FTAB + k * 2 + 1)
    p = tl.load(W + dst_p, mask=m, other=0.0).to(tl.float32)
    o = tl.load(O + src_o, mask=m, other=0.0).to(tl.float32)
    tl.store(W + dst_p, (p * decay + alpha * o).to(T_DTYPE), mask=m)


def _order(x: torch.Tensor) -> int:
    """0: C contiguous (s2 = 1, or one column); 1: R contiguous (s1 = 1, or one row); 2: neither."""
    _, R, C = x.shape
    if C == 1 or x.stride(2) == 1:
        return 0
    return 1 if R == 1 or x.stride(1) == 1 else 2


def _launch(kernel, a: list, b: list | None, slots: list, scalars: list[tuple[float, float]], BR: int = 64,
            BC: int = 64, **extra) -> None:
    groups: dict[int, list[int]] = {}
    for i, x in enumerate(a):
        if x.numel():
            groups.setdefault(_order(x), []).append(i)
    dev = a[0].device if a else None

    def table(values, dtype):  # pinned, then copied without waiting for the device (CPU: the interpreter's)
        t = torch.tensor(values, dtype=dtype)
        return t.pin_memory().to(dev, non_blocking=True) if dev.type == "cuda" else t

    for order, idx in groups.items():
        rows, starts = [], [0]
        for i in idx:
            x, s = a[i], slots[i]
            N, R, C = x.shape
            rows.append([x.data_ptr(), b[i].data_ptr() if b is not None else 0, s.data_ptr(), R, C, *x.stride()])
            starts.append(starts[-1] + N * triton.cdiv(R, BR) * triton.cdiv(C, BC))
        tab, ts, ftab = table(rows, torch.int64), table(starts, torch.int64), table([scalars[i] for i in idx],
                                                                                     torch.float32)
        P = len(idx)
        kernel[(starts[-1],)](tab, ftab, ts, P, T_DTYPE=_TL[a[0].dtype], S_DTYPE=_TL[slots[0].dtype], BR=BR, BC=BC,
                              LOG_P=max(1, (P - 1).bit_length()), ORDER=order, num_warps=4,
                              **{k: (v if v is not None else ftab) for k, v in extra.items()})


def momentum(grads: list, bufs: list, slots: list, mus: list[float], nesterovs: list[bool],
             scale: torch.Tensor | None = None) -> None:
    _launch(_momentum_kernel, grads, bufs, slots, [(float(m), float(bool(n))) for m, n in zip(mus, nesterovs)],
            SCALE=scale, HAS_SCALE=scale is not None)  # (no scale: any pointer, never read)


def update(params: list, slots: list, decays: list[float], alphas: list[float]) -> None:
    _launch(_update_kernel, params, None, slots, [(float(d), float(a)) for d, a in zip(decays, alphas)])


# ---------------------------------------------------------------- Newton-Schulz's elementwise passes

@triton.jit
def _sumsq_kernel(X, PART, M, S, CH: tl.constexpr, BLOCK: tl.constexpr):
    """PART[n, s] = sum of x^2 over chunk s (CH elements) of block n; grid (N, S)."""
    n, s = tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for i in tl.static_range(0, CH, BLOCK):
        off = s * CH + i + tl.arange(0, BLOCK)
        x = tl.load(X + n * M + off, mask=off < M, other=0.0).to(tl.float32)
        acc += x * x
    tl.store(PART + n * S + s, tl.sum(acc, axis=0))


@triton.jit
def _normalize_kernel(X, PART, OUT, M, S, eps, SP: tl.constexpr, CH: tl.constexpr, BLOCK: tl.constexpr):
    """OUT[n] = X[n] / max(||X[n]||_F, eps) in OUT's dtype, the norm summed from PART[n, :S] (in one order: the
    same bits every run); grid (N, S)."""
    n, s = tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64)
    j = tl.arange(0, SP)
    sq = tl.sum(tl.load(PART + n * S + j, mask=j < S, other=0.0), axis=0)
    inv = 1.0 / tl.maximum(tl.sqrt(sq), eps)
    for i in tl.static_range(0, CH, BLOCK):
        off = s * CH + i + tl.arange(0, BLOCK)
        m = off < M
        x = tl.load(X + n * M + off, mask=m, other=0.0).to(tl.float32)
        tl.store(OUT + n * M + off, (x * inv).to(OUT.dtype.element_ty), mask=m)


@triton.jit
def _poly_kernel(G, OUT, A, a, b, BR: tl.constexpr, BC: tl.constexpr):
    """OUT = a I + b G over [N, A, A] (contiguous), one pass in fp32 arithmetic; grid (N, cdiv(A, BR), cdiv(A, BC)),
    each program a [BR, BC] tile (its rows and columns from its position: no division per element)."""
    n = tl.program_id(0).to(tl.int64)
    i = (tl.program_id(1) * BR + tl.arange(0, BR))[:, None]
    j = (tl.program_id(2) * BC + tl.arange(0, BC))[None, :]
    m = (i < A) & (j < A)
    off = n * A * A + i * A + j
    g = tl.load(G + off, mask=m, other=0.0).to(tl.float32)
    tl.store(OUT + off, (b * g + tl.where(i == j, a, 0.0)).to(OUT.dtype.element_ty), mask=m)


_CH, _BLOCK = 16384, 2048


def normalize_blocks(x: torch.Tensor, eps: float, dtype: torch.dtype) -> torch.Tensor:
    """x [N, A, B] contiguous -> x[n] / max(||x[n]||_F, eps) per block, in ``dtype``: two launches (partial sums
    of squares per chunk, then the scaling, which sums them in a fixed order)."""
    N = x.shape[0]
    M = x[0].numel()
    S = triton.cdiv(M, _CH)
    part = torch.empty(N, S, device=x.device, dtype=torch.float32)
    out = torch.empty(x.shape, device=x.device, dtype=dtype)
    if N == 0 or M == 0:
        return out
    _sumsq_kernel[(N, S)](x, part, M, S, CH=_CH, BLOCK=_BLOCK, num_warps=8)
    _normalize_kernel[(N, S)](x, part, out, M, S, float(eps), SP=max(16, triton.next_power_of_2(S)), CH=_CH,
                              BLOCK=_BLOCK, num_warps=8)
    return out


def ns_poly(gram: torch.Tensor, a: float, b: float) -> torch.Tensor:
    """a I + b gram for gram [N, A, A] contiguous, in gram's dtype."""
    out = torch.empty_like(gram)
    N, A = gram.shape[0], gram.shape[-1]
    if gram.numel():
        _poly_kernel[(N, triton.cdiv(A, 16), triton.cdiv(A, 256))](gram, out, A, float(a), float(b), BR=16, BC=256,
                                                                   num_warps=4)
    return out
