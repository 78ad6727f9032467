"""Triton kernels of ``k3.ops.kda.decode`` (see that module for the math).

Legend: B rows, H heads, K = V head dim, HK = H*K channels per conv, W conv width, P pages; BK, BV, BW the K, V
and W-1 extents padded to powers of two.

- ``_kda_decode_kernel`` (``kda_decode_launch``): the whole decode step of one row and head per program.
- ``_conv_decode_kernel`` (``conv_decode``): the three short convs alone, for the "fla" A/B path. x3 [B,3,HK];
  tails [P,3,HK,W-1] (one slot per page, strided); y [3,B,HK] (q, k, v planes, each contiguous, as fla's
  recurrence kernel reads them).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _conv_step(X, WT, TAIL, stride_tw, mask, W: tl.constexpr, BW: tl.constexpr):
    """One block of channels of a short conv at the new token, in fp32: y = SiLU(sum_j tail_j w_j + x w_{W-1}),
    j < W-1 (oldest first); the tails shift left by one and take x, in place. X, WT, TAIL: [BC] pointers to each
    channel's new input, weights (tap 0, taps contiguous) and tail (tap 0, taps ``stride_tw`` apart)."""
    x = tl.load(X, mask=mask, other=0.0)
    acc = x.to(tl.float32) * tl.load(WT + (W - 1), mask=mask, other=0.0).to(tl.float32)
    if W > 1:
        o_w = tl.arange(0, BW)
        m_t = mask[:, None] & (o_w < W - 1)[None, :]
        p_t = TAIL[:, None] + o_w[None, :] * stride_tw
        tails = tl.load(p_t, mask=m_t, other=0.0)  # [BC,BW]
        acc += tl.sum(tails.to(tl.float32) * tl.load(WT[:, None] + o_w[None, :], mask=m_t, other=0.0).to(tl.float32),
                      axis=1)
        # tap j moves to j-1: the thread that stores it need not be the one that loaded j-1, so every load of the
        # program completes before any store (a CTA barrier)
        tl.debug_barrier()
        tl.store(p_t - stride_tw, tails, mask=m_t & (o_w >= 1)[None, :])
        tl.store(TAIL + (W - 2) * stride_tw, x.to(TAIL.dtype.element_ty), mask=mask)
    return acc * tl.sigmoid(acc)


@triton.jit
def _kda_decode_kernel(Q, K_IN, V_IN, F_IN, B_IN, WQ, WK, WV, A_LOG, DT_BIAS, STATE, CONV, IDX, O,
                       stride_qb, stride_qc, stride_kb, stride_kc, stride_vb, stride_vc, stride_fb, stride_fh,
                       stride_fk, stride_bb, stride_bh, stride_idx, stride_sp, stride_sh, stride_sk, stride_sv,
                       stride_cp, stride_cs, stride_cc, stride_cw, stride_ob, stride_oh, scale, lower_bound,
                       K: tl.constexpr, V: tl.constexpr, W: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                       BW: tl.constexpr, SOFTPLUS: tl.constexpr):
    """Program (b, h): row b's head h, its state S = STATE[IDX[b], h] [K,V] fp32 and its conv channels
    h*K .. h*K+K-1 of tails CONV[IDX[b]], both read and written in place.

    Race-freedom: the q and k tails of (b, h) are read AND shifted by this program alone, which is why one
    program takes every V block of its head (looping over them) instead of one program per V block: with several,
    the one that shifts the tails would race the others still reading them. Distinct rows hold distinct pages,
    except the padding rows of a CUDA-graph bucket, which all share the scratch page: they race there, on values
    nobody reads."""
    i_b, i_h = tl.program_id(0), tl.program_id(1)
    page = tl.load(IDX + i_b * stride_idx).to(tl.int64)  # the index may be a column of a wider table
    tails = CONV + page * stride_cp  # [3,HK,W-1] at strides (stride_cs, stride_cc, stride_cw)
    o_k = tl.arange(0, BK)
    m_k = o_k < K
    c_k = i_h * K + o_k  # this head's channels of the q and k convs

    # q, k = L2Norm(SiLU(conv)) per head (the padded lanes are SiLU(0) = 0); q carries the scale
    q = _conv_step(Q + i_b * stride_qb + c_k * stride_qc, WQ + c_k * W, tails + c_k * stride_cc, stride_cw, m_k, W, BW)
    k = _conv_step(K_IN + i_b * stride_kb + c_k * stride_kc, WK + c_k * W, tails + stride_cs + c_k * stride_cc,
                   stride_cw, m_k, W, BW)
    q = q * tl.rsqrt(tl.sum(q * q) + 1e-6) * scale
    k = k * tl.rsqrt(tl.sum(k * k) + 1e-6)

    # the gate (gate.py): z = f + dt_bias, a = e^A_log;  g = lb * sigmoid(a z)  or  g = -a * softplus(z)
    z = (tl.load(F_IN + i_b * stride_fb + i_h * stride_fh + o_k * stride_fk, mask=m_k, other=0.0).to(tl.float32)
         + tl.load(DT_BIAS + c_k, mask=m_k, other=0.0).to(tl.float32))
    a = tl.exp(tl.load(A_LOG + i_h).to(tl.float32))
    if SOFTPLUS:
        g = -a * tl.where(z > 20.0, z, tl.log(1.0 + tl.exp(z)))  # torch's softplus: z itself above 20
    else:
        g = lower_bound * tl.sigmoid(a * z)
    decay = tl.exp(g)
    beta = tl.sigmoid(tl.load(B_IN + i_b * stride_bb + i_h * stride_bh).to(tl.float32))
    k_beta = k * beta

    # S <- Diag(e^g) S;  v' = v - S^T k;  S <- S + beta k v'^T;  o = S^T q  (V block by V block, v's conv per block)
    p_state = STATE + page * stride_sp + i_h * stride_sh
    for v0 in tl.static_range(0, V, BV):
        o_v = v0 + tl.arange(0, BV)
        m_v = o_v < V
        c_v = i_h * V + o_v
        v = _conv_step(V_IN + i_b * stride_vb + c_v * stride_vc, WV + c_v * W, tails + 2 * stride_cs + c_v * stride_cc,
                       stride_cw, m_v, W, BW)
        p_s = p_state + o_k[:, None] * stride_sk + o_v[None, :] * stride_sv
        m_s = m_k[:, None] & m_v[None, :]
        s = tl.load(p_s, mask=m_s, other=0.0) * decay[:, None]  # [BK,BV] fp32
        v_new = v - tl.sum(k[:, None] * s, axis=0)
        s += k_beta[:, None] * v_new[None, :]
        tl.store(p_s, s, mask=m_s)
        tl.store(O + i_b * stride_ob + i_h * stride_oh + o_v, tl.sum(q[:, None] * s, axis=0).to(O.dtype.element_ty),
                 mask=m_v)


def kda_decode_launch(q, k, v, f, b, conv_weights, A_log, dt_bias, state, conv, index, gate_kind: str,
                      lower_bound: float, scale: float | None, block_v: int | None = None,
                      num_warps: int | None = None) -> torch.Tensor:
    """q, k, v [B,H*K], f [B,H,K], b [B,H] (any strides: column slices of one projection's output are read in
    place); conv_weights (w_q, w_k, w_v) each [HK,1,W]; A_log [H]; dt_bias [H*K]; state [P,H,K,V] fp32 and conv
    [P,3,HK,W-1] (any strides; updated at ``index``); index [B] int (any stride). One launch, grid (B, H).
    ``block_v`` (default min(V, 64), a power of two) and ``num_warps`` (default: 32 state values per thread,
    4 to 16 warps) size each program. Returns o [B,H,V] in q's dtype."""
    B, H, K = f.shape
    HK = H * K
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.shape != (B, HK):
            raise ValueError(f"{name} must be [B,H*K] = [{B},{HK}] (f is {tuple(f.shape)}); got {tuple(x.shape)}")
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
    if conv.dim() != 4 or conv.shape[1:] != (3, HK, W - 1):
        raise ValueError(f"conv tails must be [P,3,H*K,W-1] = [P,3,{HK},{W - 1}]; got {tuple(conv.shape)}")
    ws = []
    for name, w in zip(("w_q", "w_k", "w_v"), conv_weights):
        if w.numel() != HK * W:
            raise ValueError(f"{name} must be [H*K,1,W] = [{HK},1,{W}]; got {tuple(w.shape)}")
        ws.append(w.reshape(HK, W).contiguous())  # the layer's parameter: already contiguous, no copy
    if A_log.numel() != H or dt_bias is None or dt_bias.numel() != HK:
        raise ValueError(f"A_log must have H = {H} entries and dt_bias H*K = {HK}; got "
                         f"{tuple(A_log.shape)}, {None if dt_bias is None else tuple(dt_bias.shape)}")
    if gate_kind not in ("lower_bound", "softplus"):
        raise ValueError(f"unknown KDA gate {gate_kind!r}; expected 'lower_bound' or 'softplus'")
    if gate_kind == "lower_bound" and not lower_bound < 0:
        raise ValueError(f"lower_bound must be negative (K3 uses -5); got {lower_bound}")
    BK = triton.next_power_of_2(K)
    BV = block_v or min(triton.next_power_of_2(V), 64)
    if BV & (BV - 1):
        raise ValueError(f"block_v must be a power of two; got {BV}")
    num_warps = num_warps or max(4, min(16, BK * BV // 1024))
    o = torch.empty(B, H, V, dtype=q.dtype, device=q.device)
    _kda_decode_kernel[(B, H)](
        q, k, v, f, b, *ws, A_log.contiguous(), dt_bias.contiguous(), state, conv, index, o,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), *f.stride(), *b.stride(),
        index.stride(0), *state.stride(), *conv.stride(), o.stride(0), o.stride(1),
        K ** -0.5 if scale is None else scale, float(lower_bound) if gate_kind == "lower_bound" else 0.0,
        K=K, V=V, W=W, BK=BK, BV=BV, BW=triton.next_power_of_2(max(W - 1, 1)), SOFTPLUS=gate_kind == "softplus",
        num_warps=num_warps)
    return o


@triton.jit
def _conv_decode_kernel(X, WQ, WK, WV, CONV, IDX, Y, stride_xb, stride_cp, stride_yp, stride_yb, stride_idx, HK,
                        W: tl.constexpr, BLOCK: tl.constexpr):
    b = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)  # over the 3*HK channels of q, k, v
    m = offs < 3 * HK
    which, ch = offs // HK, offs % HK
    mq, mk, mv = m & (which == 0), m & (which == 1), m & (which == 2)
    page = tl.load(IDX + b * stride_idx).to(tl.int64)  # the index may be a column of a wider table
    x = tl.load(X + b * stride_xb + offs, mask=m, other=0.0).to(tl.float32)
    w_new = (tl.load(WQ + ch * W + W - 1, mask=mq, other=0.0) + tl.load(WK + ch * W + W - 1, mask=mk, other=0.0)
             + tl.load(WV + ch * W + W - 1, mask=mv, other=0.0)).to(tl.float32)
    acc = x * w_new
    tail = CONV + page * stride_cp + offs * (W - 1)  # this channel's W-1 previous inputs, oldest first
    for j in tl.static_range(W - 1):
        t_j = tl.load(tail + j, mask=m, other=0.0)
        w_j = (tl.load(WQ + ch * W + j, mask=mq, other=0.0) + tl.load(WK + ch * W + j, mask=mk, other=0.0)
               + tl.load(WV + ch * W + j, mask=mv, other=0.0)).to(tl.float32)
        acc += t_j.to(tl.float32) * w_j
        if j >= 1:
            tl.store(tail + j - 1, t_j, mask=m)  # shift the window left by one
    if W > 1:
        tl.store(tail + W - 2, x.to(CONV.dtype.element_ty), mask=m)
    y = acc * tl.sigmoid(acc)
    tl.store(Y + which * stride_yp + b * stride_yb + ch, y.to(Y.dtype.element_ty), mask=m)


def conv_decode(x3: torch.Tensor, weights, conv: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """x3 [B,3,HK]; weights (w_q, w_k, w_v) each [HK,1,W]; conv [P,3,HK,W-1] (strided slots, updated at
    ``index``). Returns y [3,B,HK] in x3's dtype."""
    B, _, HK = x3.shape
    W = weights[0].shape[-1]
    x3 = x3.contiguous()
    if conv.stride(1) != HK * (W - 1) or conv.stride(2) != W - 1 or conv.stride(3) != 1:
        raise ValueError(f"conv tails must be contiguous within a slot: strides {conv.stride()}")
    y = torch.empty(3, B, HK, dtype=x3.dtype, device=x3.device)
    block = 256
    _conv_decode_kernel[(B, triton.cdiv(3 * HK, block))](
        x3, *(w.contiguous() for w in weights), conv, index, y, x3.stride(0), conv.stride(0), y.stride(0), y.stride(1),
        index.stride(0), HK, W=W, BLOCK=block, num_warps=4)
    return y
