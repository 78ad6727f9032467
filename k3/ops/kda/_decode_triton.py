"""Triton kernel of ``k3.ops.kda.decode``: the three short convs of one decode token, tails updated in place.

Legend: B rows, HK = H*K channels per conv, W conv width; x3 [B,3,HK]; tails [P,3,HK,W-1] (one slot per page,
strided); y [3,B,HK] (q, k, v planes, each contiguous, as fla's recurrence kernel reads them).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


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
