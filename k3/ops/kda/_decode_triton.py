"""Triton kernels of ``k3.ops.kda.decode`` (see that module for the math).

Legend: B rows, H heads, K = V head dim, HK = H*K channels per conv, W conv width, P pages; BK, BV, BW the K, V
and W-1 extents padded to powers of two.

- ``_kda_decode_kernel`` (``kda_decode_launch``): the whole decode step, one program per (row, head, V block).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._arrivals import arrival_counters


@triton.jit
def _conv_window(X, WT, TAIL, stride_tw, mask, W: tl.constexpr, BW: tl.constexpr):
    """One block of channels of a short conv at the new token, in fp32: y = SiLU(sum_j tail_j w_j + x w_{W-1}),
    j < W-1 (oldest first). X, WT, TAIL: [BC] pointers to each channel's new input, weights (tap 0, taps
    contiguous) and tail (tap 0, taps ``stride_tw`` apart). Returns (y, x, tails [BC,BW]); nothing is stored."""
    x = tl.load(X, mask=mask, other=0.0)
    acc = x.to(tl.float32) * tl.load(WT + (W - 1), mask=mask, other=0.0).to(tl.float32)
    o_w = tl.arange(0, BW)
    m_t = mask[:, None] & (o_w < W - 1)[None, :]
    tails = tl.load(TAIL[:, None] + o_w[None, :] * stride_tw, mask=m_t, other=0.0)  # [BC,BW]
    acc += tl.sum(tails.to(tl.float32) * tl.load(WT[:, None] + o_w[None, :], mask=m_t, other=0.0).to(tl.float32),
                  axis=1)
    return acc * tl.sigmoid(acc), x, tails


@triton.jit
def _shift_tails(x, tails, TAIL, stride_tw, mask, W: tl.constexpr, BW: tl.constexpr):
    """The tails of ``_conv_window`` shift left by one and take x, in place. Tap j moves to j-1: the thread that
    stores it need not be the one that loaded j-1, so every load of the program completes before any store (a
    CTA barrier)."""
    o_w = tl.arange(0, BW)
    m_t = mask[:, None] & (o_w < W - 1)[None, :]
    tl.debug_barrier()
    tl.store(TAIL[:, None] + (o_w[None, :] - 1) * stride_tw, tails, mask=m_t & (o_w >= 1)[None, :])
    tl.store(TAIL + (W - 2) * stride_tw, x.to(TAIL.dtype.element_ty), mask=mask)


@triton.jit
def _kda_decode_kernel(Q, K_IN, V_IN, F_IN, FB, B_IN, WQ, WK, WV, A_LOG, DT_BIAS, STATE, CONV, IDX, O, COUNT,
                       stride_qb, stride_qc, stride_kb, stride_kc, stride_vb, stride_vc, stride_fb, stride_fh,
                       stride_fk, stride_wo, stride_wi, stride_bb, stride_bh, stride_idx, stride_sp, stride_sh,
                       stride_sk, stride_sv, stride_cp, stride_cs, stride_cc, stride_cw, stride_ob, stride_oh, scale,
                       lower_bound, H, K: tl.constexpr, V: tl.constexpr, W: tl.constexpr, BK: tl.constexpr,
                       BV: tl.constexpr, BW: tl.constexpr, RF: tl.constexpr, BR: tl.constexpr, NV: tl.constexpr,
                       SOFTPLUS: tl.constexpr):
    """Program (b, h, j): row b's head h, V block j of its state S = STATE[IDX[b], h] [K,V] fp32, read and written
    in place; its conv channels h*K .. h*K+K-1 of tails CONV[IDX[b]].

    With RF > 0, F_IN is the gate's low-rank input f_a [B,RF] and FB its second projection [H*K,RF]: the program
    computes its head's f = FB[hK:hK+K] f_a itself (rounded to f_a's dtype, as F.linear's output would be).

    Race-freedom: v's tails are split by V block like the state, each shifted by its own program. Every one of
    the head's NV programs reads the q and k tails of (b, h); the last of them to arrive (a counter per (b, h),
    acquire-release, reset by that program) shifts them, once all have read. Distinct rows hold distinct pages,
    except the padding rows of a CUDA-graph bucket, which all share the scratch page: they race there, on values
    nobody reads."""
    i_b, i_h, i_v = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    page = tl.load(IDX + i_b * stride_idx).to(tl.int64)  # the index may be a column of a wider table
    tails = CONV + page * stride_cp  # [3,HK,W-1] at strides (stride_cs, stride_cc, stride_cw)
    o_k = tl.arange(0, BK)
    m_k = o_k < K
    c_k = i_h * K + o_k  # this head's channels of the q and k convs

    # q, k = L2Norm(SiLU(conv)) per head (the padded lanes are SiLU(0) = 0); q carries the scale
    tq, tk = tails + c_k * stride_cc, tails + stride_cs + c_k * stride_cc
    q, xq, q_tails = _conv_window(Q + i_b * stride_qb + c_k * stride_qc, WQ + c_k * W, tq, stride_cw, m_k, W, BW)
    k, xk, k_tails = _conv_window(K_IN + i_b * stride_kb + c_k * stride_kc, WK + c_k * W, tk, stride_cw, m_k, W, BW)
    q = q * tl.rsqrt(tl.sum(q * q) + 1e-6) * scale
    k = k * tl.rsqrt(tl.sum(k * k) + 1e-6)

    # the gate (gate.py): z = f + dt_bias, a = e^A_log;  g = lb * sigmoid(a z)  or  g = -a * softplus(z)
    if RF > 0:
        f = tl.zeros([BK], dtype=tl.float32)
        for r0 in tl.static_range(0, RF, BR):
            o_r = r0 + tl.arange(0, BR)
            m_r = o_r < RF
            fa = tl.load(F_IN + i_b * stride_fb + o_r * stride_fk, mask=m_r, other=0.0).to(tl.float32)
            w = tl.load(FB + c_k[:, None] * stride_wo + o_r[None, :] * stride_wi, mask=m_k[:, None] & m_r[None, :],
                        other=0.0).to(tl.float32)
            f += tl.sum(w * fa[None, :], axis=1)
        f = f.to(F_IN.dtype.element_ty).to(tl.float32)
    else:
        f = tl.load(F_IN + i_b * stride_fb + i_h * stride_fh + o_k * stride_fk, mask=m_k, other=0.0).to(tl.float32)
    z = f + tl.load(DT_BIAS + c_k, mask=m_k, other=0.0).to(tl.float32)
    a = tl.exp(tl.load(A_LOG + i_h).to(tl.float32))
    if SOFTPLUS:
        g = -a * tl.where(z > 20.0, z, tl.log(1.0 + tl.exp(z)))  # torch's softplus: z itself above 20
    else:
        g = lower_bound * tl.sigmoid(a * z)
    decay = tl.exp(g)
    beta = tl.sigmoid(tl.load(B_IN + i_b * stride_bb + i_h * stride_bh).to(tl.float32))
    k_beta = k * beta

    # this program's V block: v's conv, then S <- Diag(e^g) S;  v' = v - S^T k;  S <- S + beta k v'^T;  o = S^T q
    o_v = i_v * BV + tl.arange(0, BV)
    m_v = o_v < V
    c_v = i_h * V + o_v
    tv = tails + 2 * stride_cs + c_v * stride_cc
    v, xv, v_tails = _conv_window(V_IN + i_b * stride_vb + c_v * stride_vc, WV + c_v * W, tv, stride_cw, m_v, W, BW)
    p_s = STATE + page * stride_sp + i_h * stride_sh + o_k[:, None] * stride_sk + o_v[None, :] * stride_sv
    m_s = m_k[:, None] & m_v[None, :]
    s = tl.load(p_s, mask=m_s, other=0.0) * decay[:, None]  # [BK,BV] fp32
    v_new = v - tl.sum(k[:, None] * s, axis=0)
    s += k_beta[:, None] * v_new[None, :]
    tl.store(p_s, s, mask=m_s)
    tl.store(O + i_b * stride_ob + i_h * stride_oh + o_v, tl.sum(q[:, None] * s, axis=0).to(O.dtype.element_ty),
             mask=m_v)
    if W > 1:
        _shift_tails(xv, v_tails, tv, stride_cw, m_v, W, BW)
        if NV == 1:
            _shift_tails(xq, q_tails, tq, stride_cw, m_k, W, BW)
            _shift_tails(xk, k_tails, tk, stride_cw, m_k, W, BW)
        else:
            tl.debug_barrier()  # every thread's loads of the q/k tails are done before the arrival is counted
            arrived = tl.atomic_add(COUNT + i_b * H + i_h, 1, sem="acq_rel")
            if arrived == NV - 1:  # the last: the others have all read the tails
                _shift_tails(xq, q_tails, tq, stride_cw, m_k, W, BW)
                _shift_tails(xk, k_tails, tk, stride_cw, m_k, W, BW)
                tl.atomic_xchg(COUNT + i_b * H + i_h, 0, sem="relaxed")


# rows up to which the gate's second projection runs inside the kernel (each of a head's NV programs reads its
# K x RF slice of f_b: NV times the weight per row, which pays against a separate matrix-vector launch only for
# a few rows); more rows: one F.linear before the kernel
FUSE_GATE_ROWS = 8


def kda_decode_launch(q, k, v, f, b, conv_weights, A_log, dt_bias, state, conv, index, gate_kind: str,
                      lower_bound: float, scale: float | None, block_v: int | None = None,
                      num_warps: int | None = None, f_b_weight: torch.Tensor | None = None) -> torch.Tensor:
    """q, k, v [B,H*K], f [B,H,K] (or, with ``f_b_weight`` [H*K,RF], the gate's low-rank input f_a [B,RF]), b [B,H]
    (any strides: column slices of one projection's output are read in place); conv_weights (w_q, w_k, w_v) each
    [HK,1,W]; A_log [H]; dt_bias [H*K]; state [P,H,K,V] fp32 and conv [P,3,HK,W-1] (any strides; updated at
    ``index``); index [B] int (any stride). One launch, grid (B, H, V / block_v). ``block_v`` (default
    min(V, 32), a power of two) and ``num_warps`` (default: 32 state values per thread, 4 to 16 warps) size each
    program. Returns o [B,H,V] in q's dtype."""
    H = A_log.numel()
    B, HK = q.shape[0], q.shape[-1]
    if H == 0 or HK % H:
        raise ValueError(f"q's width H*K = {HK} must be a multiple of A_log's H = {H} entries")
    K = HK // H
    if f_b_weight is None:
        if f.shape != (B, H, K):
            raise ValueError(f"f must be [B,H,K] = [{B},{H},{K}]; got {tuple(f.shape)}")
    else:
        RF = f_b_weight.shape[-1]
        if f_b_weight.shape != (HK, RF) or f.shape != (B, RF):
            raise ValueError(f"with f_b_weight [H*K,RF] = [{HK},RF], f must be f_a [B,RF]; got f_b_weight "
                             f"{tuple(f_b_weight.shape)}, f {tuple(f.shape)}")
        if B > FUSE_GATE_ROWS:
            f, f_b_weight = torch.nn.functional.linear(f, f_b_weight).view(B, H, K), None
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.shape != (B, HK):
            raise ValueError(f"{name} must be [B,H*K] = [{B},{HK}] (A_log has H = {H}); got {tuple(x.shape)}")
        if x.dtype != q.dtype:
            raise ValueError(f"q, k and v must share one dtype; got {q.dtype}, {k.dtype}, {v.dtype}")
    if b.shape != (B, H):
        raise ValueError(f"b (raw beta logits) must be [B,H] = [{B},{H}]; got {tuple(b.shape)}")
    if index.shape != (B,):
        raise ValueError(f"index must be [B] = [{B}]; got {tuple(index.shape)}")
    V = K  # the value convs' tails share the q/k layout [HK,W-1]
    if state.dim() != 4 or state.shape[1:] != (H, K, V) or state.dtype != torch.float32:
        raise ValueError(f"state must be [P,H,K,V] = [P,{H},{K},{V}] fp32; got {tuple(state.shape)} {state.dtype}")
    W = conv_weights[0].shape[-1]
    if W < 2:
        raise ValueError(f"the short convs must be at least 2 taps wide; got {W}")
    if conv.dim() != 4 or conv.shape[1:] != (3, HK, W - 1):
        raise ValueError(f"conv tails must be [P,3,H*K,W-1] = [P,3,{HK},{W - 1}]; got {tuple(conv.shape)}")
    ws = []
    for name, w in zip(("w_q", "w_k", "w_v"), conv_weights):
        if w.numel() != HK * W:
            raise ValueError(f"{name} must be [H*K,1,W] = [{HK},1,{W}]; got {tuple(w.shape)}")
        ws.append(w.reshape(HK, W).contiguous())  # the layer's parameter: already contiguous, no copy
    if dt_bias is None or dt_bias.numel() != HK:
        got = None if dt_bias is None else tuple(dt_bias.shape)
        raise ValueError(f"dt_bias must have H*K = {HK} entries; got {got}")
    if gate_kind not in ("lower_bound", "softplus"):
        raise ValueError(f"unknown KDA gate {gate_kind!r}; expected 'lower_bound' or 'softplus'")
    if gate_kind == "lower_bound" and not lower_bound < 0:
        raise ValueError(f"lower_bound must be negative (K3 uses -5); got {lower_bound}")
    BK = triton.next_power_of_2(K)
    BV = block_v or min(triton.next_power_of_2(V), 32)
    if BV & (BV - 1):
        raise ValueError(f"block_v must be a power of two; got {BV}")
    NV = triton.cdiv(V, BV)
    num_warps = num_warps or max(4, min(16, BK * BV // 1024))
    o = torch.empty(B, H, V, dtype=q.dtype, device=q.device)
    if f_b_weight is None:
        RF, fb, f_strides, w_strides = 0, f, f.stride(), (0, 0)
    else:
        RF, fb = f_b_weight.shape[-1], f_b_weight
        f_strides, w_strides = (f.stride(0), 0, f.stride(1)), f_b_weight.stride()
    _kda_decode_kernel[(B, H, NV)](
        q, k, v, f, fb, b, *ws, A_log.contiguous(), dt_bias.contiguous(), state, conv, index, o,
        arrival_counters(q.device, B * H, "kda_decode"),
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), *f_strides, *w_strides,
        *b.stride(), index.stride(0), *state.stride(), *conv.stride(), o.stride(0), o.stride(1),
        K ** -0.5 if scale is None else scale, float(lower_bound) if gate_kind == "lower_bound" else 0.0, H,
        K=K, V=V, W=W, BK=BK, BV=BV, BW=triton.next_power_of_2(W - 1), RF=RF,
        BR=min(32, triton.next_power_of_2(max(RF, 1))), NV=NV, SOFTPLUS=gate_kind == "softplus", num_warps=num_warps)
    return o
