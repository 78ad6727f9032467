"""Triton kernels of ``k3.ops.attn_res.attn_res_mix_norm`` (imported only when Triton is there). The math is in
that function's docstring.

Legend: S sources (NUM_S of them, BLOCK_S padded; each its own [N,D] tensor, read in place), N rows (tokens), D
hidden (BLOCK_D per inner step), BLOCK_N rows per program, G row groups of the weight-gradient kernel.
Per-row statistics live in a [3,S,N] fp32 tensor: the softmax weight a, the key's inverse RMS r and the dot v.u.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_SOURCES = 12


@triton.jit
def _pick(s: tl.constexpr, P0, P1, P2, P3, P4, P5, P6, P7, P8, P9, P10, P11):
    if s == 0:
        return P0
    elif s == 1:
        return P1
    elif s == 2:
        return P2
    elif s == 3:
        return P3
    elif s == 4:
        return P4
    elif s == 5:
        return P5
    elif s == 6:
        return P6
    elif s == 7:
        return P7
    elif s == 8:
        return P8
    elif s == 9:
        return P9
    elif s == 10:
        return P10
    else:
        return P11


@triton.jit
def _row(x, sidx, s: tl.constexpr):
    """Row s of a [BLOCK_S, BLOCK_N] register tile, as [BLOCK_N]."""
    return tl.sum(tl.where(sidx[:, None] == s, x, 0.0), 0)


@triton.jit
def _put(x, sidx, s: tl.constexpr, value):
    """x with ``value`` [BLOCK_N] added to its row s."""
    return x + tl.where(sidx[:, None] == s, value[None, :], 0.0)


@triton.jit
def _mix_chunk(S0, S1, S2, S3, S4, S5, S6, S7, S8, S9, S10, S11, a, sidx, offs, mask,
               NUM_S: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """h = sum_s a_s v_s over one [BLOCK_N, BLOCK_D] tile, fp32."""
    h = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    for s in tl.static_range(NUM_S):
        v = tl.load(_pick(s, S0, S1, S2, S3, S4, S5, S6, S7, S8, S9, S10, S11) + offs, mask=mask, other=0.0)
        h += _row(a, sidx, s)[:, None] * v.to(tl.float32)
    return h


@triton.jit
def _fwd_kernel(S0, S1, S2, S3, S4, S5, S6, S7, S8, S9, S10, S11, U, NW, OUT, STATS, R2, N, D, eps, norm_eps,
                NUM_S: tl.constexpr, HAS_NORM: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_N: tl.constexpr,
                BLOCK_D: tl.constexpr):
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    mn = offs_n < N
    sidx = tl.arange(0, BLOCK_S)
    rows = offs_n[:, None].to(tl.int64) * D
    ss = tl.zeros([BLOCK_S, BLOCK_N], tl.float32)
    dot = tl.zeros([BLOCK_S, BLOCK_N], tl.float32)
    for d0 in range(0, D, BLOCK_D):  # each source's sum of squares and dot with u
        offs_d = d0 + tl.arange(0, BLOCK_D)
        md = offs_d < D
        mask = mn[:, None] & md[None, :]
        u = tl.load(U + offs_d, mask=md, other=0.0)
        for s in tl.static_range(NUM_S):
            v = tl.load(_pick(s, S0, S1, S2, S3, S4, S5, S6, S7, S8, S9, S10, S11) + rows + offs_d[None, :],
                        mask=mask, other=0.0).to(tl.float32)
            ss = _put(ss, sidx, s, tl.sum(v * v, 1))
            dot = _put(dot, sidx, s, tl.sum(v * u[None, :], 1))
    r = 1.0 / tl.sqrt(ss / D + eps)
    logit = tl.where(sidx[:, None] < NUM_S, dot * r, float("-inf"))
    e = tl.exp(logit - tl.max(logit, 0)[None, :])
    a = e / tl.sum(e, 0)[None, :]
    smask = (sidx[:, None] < NUM_S) & mn[None, :]
    st = STATS + sidx[:, None].to(tl.int64) * N + offs_n[None, :]
    tl.store(st, a, mask=smask)
    tl.store(st + NUM_S * N, r, mask=smask)
    tl.store(st + 2 * NUM_S * N, dot, mask=smask)
    hs = tl.zeros([BLOCK_N], tl.float32)
    for d0 in range(0, D, BLOCK_D):  # h = sum_s a_s v_s, rounded to the sources' dtype
        offs_d = d0 + tl.arange(0, BLOCK_D)
        mask = mn[:, None] & (offs_d < D)[None, :]
        h = _mix_chunk(S0, S1, S2, S3, S4, S5, S6, S7, S8, S9, S10, S11, a, sidx, rows + offs_d[None, :], mask,
                       NUM_S, BLOCK_N, BLOCK_D).to(OUT.dtype.element_ty)
        tl.store(OUT + rows + offs_d[None, :], h, mask=mask)
        if HAS_NORM:
            hf = h.to(tl.float32)
            hs += tl.sum(hf * hf, 1)
    if HAS_NORM:  # the sub-layer's pre-norm over the rounded h, in place
        r2 = 1.0 / tl.sqrt(hs / D + norm_eps)
        tl.store(R2 + offs_n, r2, mask=mn)
        for d0 in range(0, D, BLOCK_D):
            offs_d = d0 + tl.arange(0, BLOCK_D)
            md = offs_d < D
            mask = mn[:, None] & md[None, :]
            h = tl.load(OUT + rows + offs_d[None, :], mask=mask, other=0.0).to(tl.float32)
            nw = tl.load(NW + offs_d, mask=md, other=0.0)
            tl.store(OUT + rows + offs_d[None, :], (h * r2[:, None] * nw[None, :]).to(OUT.dtype.element_ty), mask=mask)


@triton.jit
def _bwd_rows_kernel(S0, S1, S2, S3, S4, S5, S6, S7, S8, S9, S10, S11, DY, NW, STATS, R2, COEF, C1, N, D,
                     NUM_S: tl.constexpr, HAS_NORM: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_D: tl.constexpr, OUT_DTYPE: tl.constexpr):
    """Per row: the logits' gradients. Writes COEF [2,S,N] = (dl_s r_s, dl_s r_s^3 dot_s / D) and, with the norm,
    C1 [N] = r2^3 sum_d h nw dy / D."""
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    mn = offs_n < N
    sidx = tl.arange(0, BLOCK_S)
    smask = (sidx[:, None] < NUM_S) & mn[None, :]
    st = STATS + sidx[:, None].to(tl.int64) * N + offs_n[None, :]
    a = tl.load(st, mask=smask, other=0.0)
    r = tl.load(st + NUM_S * N, mask=smask, other=0.0)
    dot = tl.load(st + 2 * NUM_S * N, mask=smask, other=0.0)
    rows = offs_n[:, None].to(tl.int64) * D
    e = tl.zeros([BLOCK_S, BLOCK_N], tl.float32)  # v_s . (nw * dy)  (v_s . dy without the norm)
    f = tl.zeros([BLOCK_S, BLOCK_N], tl.float32)  # v_s . h
    c1 = tl.zeros([BLOCK_N], tl.float32)  # h . (nw * dy)
    for d0 in range(0, D, BLOCK_D):
        offs_d = d0 + tl.arange(0, BLOCK_D)
        md = offs_d < D
        mask = mn[:, None] & md[None, :]
        g = tl.load(DY + rows + offs_d[None, :], mask=mask, other=0.0).to(tl.float32)
        if HAS_NORM:
            g = g * tl.load(NW + offs_d, mask=md, other=0.0)[None, :]
            h = _mix_chunk(S0, S1, S2, S3, S4, S5, S6, S7, S8, S9, S10, S11, a, sidx, rows + offs_d[None, :], mask,
                           NUM_S, BLOCK_N, BLOCK_D).to(OUT_DTYPE).to(tl.float32)
            c1 += tl.sum(h * g, 1)
        for s in tl.static_range(NUM_S):
            v = tl.load(_pick(s, S0, S1, S2, S3, S4, S5, S6, S7, S8, S9, S10, S11) + rows + offs_d[None, :],
                        mask=mask, other=0.0).to(tl.float32)
            e = _put(e, sidx, s, tl.sum(v * g, 1))
            if HAS_NORM:
                f = _put(f, sidx, s, tl.sum(v * h, 1))
    if HAS_NORM:  # dh = r2 nw dy - h r2^3 c1 / D, so v_s . dh = r2 e_s - (r2^3 c1 / D) f_s
        r2 = tl.load(R2 + offs_n, mask=mn, other=0.0)
        k = r2 * r2 * r2 * c1 / D
        da = r2[None, :] * e - k[None, :] * f
        tl.store(C1 + offs_n, k, mask=mn)
    else:
        da = e
    dl = a * (da - tl.sum(a * da, 0)[None, :])  # softmax backward
    co = COEF + sidx[:, None].to(tl.int64) * N + offs_n[None, :]
    tl.store(co, dl * r, mask=smask)
    tl.store(co + NUM_S * N, dl * r * r * r * dot / D, mask=smask)


@triton.jit
def _bwd_cols_kernel(S0, S1, S2, S3, S4, S5, S6, S7, S8, S9, S10, S11, G0, G1, G2, G3, G4, G5, G6, G7, G8, G9, G10,
                     G11, DY, U, NW, STATS, R2, COEF, C1, DU, DNW, N, D, rows_per_group,
                     NUM_S: tl.constexpr, HAS_NORM: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_D: tl.constexpr, OUT_DTYPE: tl.constexpr, ACC: tl.constexpr):
    """One D tile of a group of rows: every source's gradient dv_s = a_s dh + (dl_s r_s) u - (dl_s r_s^3 dot_s / D)
    v_s, and the group's partial weight gradients du = sum_rows sum_s dl_s r_s v_s, dnw = sum_rows dy h r2. Bit s of
    ACC set: dv_s is added to what G_s holds (a gradient summed over several mixes) instead of written."""
    pd = tl.program_id(0)
    grp = tl.program_id(1)
    offs_d = pd * BLOCK_D + tl.arange(0, BLOCK_D)
    md = offs_d < D
    sidx = tl.arange(0, BLOCK_S)
    u = tl.load(U + offs_d, mask=md, other=0.0)
    if HAS_NORM:
        nw = tl.load(NW + offs_d, mask=md, other=0.0)
    du = tl.zeros([BLOCK_D], tl.float32)
    dnw = tl.zeros([BLOCK_D], tl.float32)
    lo = grp * rows_per_group
    for n0 in range(lo, tl.minimum(lo + rows_per_group, N), BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mn = offs_n < N
        smask = (sidx[:, None] < NUM_S) & mn[None, :]
        sn = sidx[:, None].to(tl.int64) * N + offs_n[None, :]
        a = tl.load(STATS + sn, mask=smask, other=0.0)
        coef = tl.load(COEF + sn, mask=smask, other=0.0)
        kk = tl.load(COEF + NUM_S * N + sn, mask=smask, other=0.0)
        rows = offs_n[:, None].to(tl.int64) * D
        mask = mn[:, None] & md[None, :]
        dh = tl.load(DY + rows + offs_d[None, :], mask=mask, other=0.0).to(tl.float32)
        if HAS_NORM:
            h = _mix_chunk(S0, S1, S2, S3, S4, S5, S6, S7, S8, S9, S10, S11, a, sidx, rows + offs_d[None, :], mask,
                           NUM_S, BLOCK_N, BLOCK_D).to(OUT_DTYPE).to(tl.float32)
            r2 = tl.load(R2 + offs_n, mask=mn, other=0.0)
            c1 = tl.load(C1 + offs_n, mask=mn, other=0.0)
            dnw += tl.sum(dh * h * r2[:, None], 0)
            dh = r2[:, None] * nw[None, :] * dh - c1[:, None] * h
        for s in tl.static_range(NUM_S):
            v = tl.load(_pick(s, S0, S1, S2, S3, S4, S5, S6, S7, S8, S9, S10, S11) + rows + offs_d[None, :],
                        mask=mask, other=0.0).to(tl.float32)
            c_s = _row(coef, sidx, s)
            dv = _row(a, sidx, s)[:, None] * dh + c_s[:, None] * u[None, :] - _row(kk, sidx, s)[:, None] * v
            gs = _pick(s, G0, G1, G2, G3, G4, G5, G6, G7, G8, G9, G10, G11)
            if (ACC >> s) & 1:
                dv += tl.load(gs + rows + offs_d[None, :], mask=mask, other=0.0).to(tl.float32)
            tl.store(gs + rows + offs_d[None, :], dv.to(gs.dtype.element_ty), mask=mask)
            du += tl.sum(c_s[:, None] * v, 0)
    tl.store(DU + grp * D + offs_d, du, mask=md)
    if HAS_NORM:
        tl.store(DNW + grp * D + offs_d, dnw, mask=md)


@triton.jit
def _rows_kernel(S0, S1, S2, S3, S4, S5, S6, S7, S8, S9, S10, S11, DELTA, NEWP, Q, KN, NW, OUT, D, eps, norm_eps,
                 NUM_S: tl.constexpr, HAS_DELTA: tl.constexpr, HAS_NORM: tl.constexpr, BLOCK_D: tl.constexpr):
    """Inference, one row per program, the whole row in registers: with HAS_DELTA the last source is first
    v = round(S_last + DELTA), the residual add of the sub-layer before (written to NEWP, the new partial sum);
    then one pass over the sources with an online softmax, m = max logit so far, h = sum_s e^(l_s - m) v_s / sum_s
    e^(l_s - m), rounded, and the pre-norm over the rounded h. No statistics kept: nothing to differentiate."""
    n = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_D)
    md = offs < D
    u = tl.load(Q + offs, mask=md, other=0.0).to(tl.float32) * tl.load(KN + offs, mask=md, other=0.0).to(tl.float32)
    m = float("-inf")
    den = 0.0
    acc = tl.zeros([BLOCK_D], tl.float32)
    for s in tl.static_range(NUM_S):
        P = _pick(s, S0, S1, S2, S3, S4, S5, S6, S7, S8, S9, S10, S11)
        v = tl.load(P + n * D + offs, mask=md, other=0.0)
        if HAS_DELTA and s == NUM_S - 1:
            v = (v.to(tl.float32) + tl.load(DELTA + n * D + offs, mask=md, other=0.0).to(tl.float32)).to(
                OUT.dtype.element_ty)
            tl.store(NEWP + n * D + offs, v, mask=md)
        v = v.to(tl.float32)
        logit = tl.sum(v * u, 0) / tl.sqrt(tl.sum(v * v, 0) / D + eps)
        m_new = tl.maximum(m, logit)
        c = tl.exp(m - m_new)
        e = tl.exp(logit - m_new)
        acc = acc * c + e * v
        den = den * c + e
        m = m_new
    h = (acc / den).to(OUT.dtype.element_ty)
    if HAS_NORM:
        hf = h.to(tl.float32)
        r2 = 1.0 / tl.sqrt(tl.sum(hf * hf, 0) / D + norm_eps)
        h = (hf * r2 * tl.load(NW + offs, mask=md, other=0.0).to(tl.float32)).to(OUT.dtype.element_ty)
    tl.store(OUT + n * D + offs, h, mask=md)


_TL = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


def _padded(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    return list(tensors) + [tensors[0]] * (MAX_SOURCES - len(tensors))


def forward(sources: list[torch.Tensor], u: torch.Tensor, nw: torch.Tensor | None, eps: float, norm_eps: float,
            block_n: int = 8, block_d: int = 256):
    """sources: S contiguous [N,D] tensors of one dtype; u [D] fp32; nw [D] fp32 or None -> (out [N,D], stats
    [3,S,N] fp32, r2 [N] fp32)."""
    S, (N, D) = len(sources), sources[0].shape
    out = torch.empty_like(sources[0])
    stats = torch.empty(3, S, N, dtype=torch.float32, device=out.device)
    r2 = torch.empty(N if nw is not None else 1, dtype=torch.float32, device=out.device)
    _fwd_kernel[(triton.cdiv(N, block_n),)](
        *_padded(sources), u, nw if nw is not None else u, out, stats, r2, N, D, eps, norm_eps, NUM_S=S,
        HAS_NORM=nw is not None, BLOCK_S=max(2, triton.next_power_of_2(S)), BLOCK_N=block_n,
        BLOCK_D=min(block_d, max(16, triton.next_power_of_2(D))), num_warps=4)
    return out, stats, r2


def backward(dy: torch.Tensor, sources: list[torch.Tensor], u: torch.Tensor, nw: torch.Tensor | None,
             stats: torch.Tensor, r2: torch.Tensor, block_n: int = 8, block_d: int = 256,
             cols: tuple[int, int, int] = (32, 128, 4), programs_per_sm: int = 8, groups: int | None = None,
             into: list[torch.Tensor | None] | None = None):
    """-> (the sources' gradients [N,D] each, du [D] fp32, dnw [D] fp32 or None). ``into``: per source a contiguous
    [N,D] gradient to add this one to in place (returned as that source's), or None for a new one. ``cols`` = (rows
    per tile, D per tile, warps) of the second kernel, which streams every source twice and writes its gradient: its
    tiles are larger than the first kernel's so that each program keeps more bytes in flight
    (``benchmarks/bench_attn_res.py`` measures the choices)."""
    S, (N, D) = len(sources), sources[0].shape
    dy = dy.contiguous()
    into = into or [None] * S
    grads = [g if g is not None else torch.empty_like(s) for s, g in zip(sources, into)]
    acc = sum(1 << i for i, g in enumerate(into) if g is not None)
    coef = torch.empty(2, S, N, dtype=torch.float32, device=dy.device)
    c1 = torch.empty(N if nw is not None else 1, dtype=torch.float32, device=dy.device)
    bs = max(2, triton.next_power_of_2(S))
    bd = min(block_d, max(16, triton.next_power_of_2(D)))
    meta = dict(NUM_S=S, HAS_NORM=nw is not None, BLOCK_S=bs, OUT_DTYPE=_TL[sources[0].dtype])
    nw_arg = nw if nw is not None else u
    _bwd_rows_kernel[(triton.cdiv(N, block_n),)](*_padded(sources), dy, nw_arg, stats, r2, coef, c1, N, D,
                                                 BLOCK_N=block_n, BLOCK_D=bd, num_warps=4, **meta)
    cn, cd, cw = cols
    cd = min(cd, max(16, triton.next_power_of_2(D)))
    if groups is None:  # enough programs to fill the device; each group's weight-gradient partial sums in registers
        sms = torch.cuda.get_device_properties(dy.device).multi_processor_count if dy.is_cuda else 4
        groups = max(1, min(triton.cdiv(N, cn), programs_per_sm * sms // triton.cdiv(D, cd)))
    rows_per_group = triton.cdiv(triton.cdiv(N, groups), cn) * cn
    groups = triton.cdiv(N, rows_per_group)
    du = torch.empty(groups, D, dtype=torch.float32, device=dy.device)
    dnw = torch.empty(groups if nw is not None else 1, D, dtype=torch.float32, device=dy.device)
    _bwd_cols_kernel[(triton.cdiv(D, cd), groups)](*_padded(sources), *_padded(grads), dy, u, nw_arg, stats, r2, coef,
                                                   c1, du, dnw, N, D, rows_per_group, BLOCK_N=cn, BLOCK_D=cd,
                                                   num_warps=cw, ACC=acc, **meta)
    return grads, du.sum(0), (dnw.sum(0) if nw is not None else None)


def rows(sources: list[torch.Tensor], delta: torch.Tensor | None, query: torch.Tensor, key_norm: torch.Tensor,
         nw: torch.Tensor | None, eps: float, norm_eps: float,
         num_warps: int | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Inference: sources S contiguous [N,D] tensors of one dtype (with ``delta`` [N,D], the last one is replaced by
    last + delta first); query, key_norm, nw [D] in any dtype (nw may be None), widened in the kernel -> (out [N,D],
    the new last source or None)."""
    S, (N, D) = len(sources), sources[0].shape
    out = torch.empty_like(sources[0])
    newp = torch.empty_like(sources[0]) if delta is not None else None
    _rows_kernel[(N,)](*_padded(sources), delta if delta is not None else out, newp if newp is not None else out,
                       query, key_norm, nw if nw is not None else query, out, D, eps, norm_eps, NUM_S=S, HAS_DELTA=delta is not None,
                       HAS_NORM=nw is not None, BLOCK_D=max(16, triton.next_power_of_2(D)),
                       num_warps=num_warps or (4 if D <= 2048 else 8))
    return out, newp
