"""The LM head and its cross-entropy as one op whose gradient is computed in the forward (the training loss, SPEC §7).

``linear_ce_sum(h, W, y, chunk)`` = sum over rows t with y_t != -100 of CE(h_t W^T, y_t), chunk by chunk of n rows:

  z   = h W^T                                   [n,V]   GEMM 1 (bf16 under autocast, fp32 accumulation)
  lse = log sum_v exp z_v                       (fp32)
  L   = sum_t (lse_t - z_{t,y_t})               counted rows only
  G   = softmax(z) - onehot(y)                  dL/dz, 0 on ignored rows
  dh  = G W                                     [n,D]   GEMM 2
  dW += G^T h                                   [V,D]   GEMM 3 (summed over chunks in fp32: on CUDA inside the
                                                                GEMM, cuBLAS accumulating into the fp32 sum)

The backward only scales dh and dW by the loss's incoming gradient (a scalar). Three GEMMs per chunk, where
computing the chunk's logits under activation checkpointing takes four (forward, recompute, two gradients), and a
chunk's [n,V] logits never outlive it (Liger-Kernel's fused linear cross-entropy does the same). The chunk's
logits and G are the "lm_loss" region: plain torch ops, which ``k3 train --compile`` compiles (GEMM 1 beside the
fp32 cast, log-sum-exp, pick and softmax gradient as one reduction over the logits and a scatter of the n target
entries); GEMMs 2 and 3 follow it, dh written into its rows of the result; eager, a chunk holds its logits and one
fp32 temporary.

Equivalence (tests/ops/test_linear_ce.py): loss, dh and dW equal autograd through ``F.cross_entropy(h @ W.T,
reduction="sum")`` to float rounding, at any chunk size and vocabulary padding.

Padding: on CUDA the GEMMs run over the vocabulary rounded up to a multiple of 64 (zero rows of W, their logits set
to -inf inside the region, so G is 0 there and dW's extra rows are dropped): a vocabulary whose rows are not a
multiple of 16 bytes (e.g. 18,078 tokens) otherwise sends all three GEMMs to cuBLAS's slower unaligned kernels
(measured on `small`: the loss's forward 16.5 -> 53.7 ms per step on 8 x 4096 tokens).
"""

from __future__ import annotations

import torch

from .regions import region
from .precision import autocast_dtype

__all__ = ["linear_ce_sum"]


def _ce_chunk(h: torch.Tensor, w: torch.Tensor, y: torch.Tensor, need_grad: bool, vocab: int):
    """One chunk (the "lm_loss" region): (summed CE in fp32 or wider, dL/dz [n,V'] in z's dtype or None) for h [n,D],
    w [V',D] (one dtype; rows from ``vocab`` on are padding, their logits -inf: G is 0 there), y [n] (-100 ignored)."""
    z = h @ w.t()
    zf = z.to(torch.promote_types(z.dtype, torch.float32))  # fp32 (fp64 stays fp64)
    if vocab < w.shape[0]:
        zf = torch.where(torch.arange(w.shape[0], device=zf.device) < vocab, zf, float("-inf"))
    lse = torch.logsumexp(zf, dim=-1)
    counted = y != -100
    y0 = torch.where(counted, y, 0)
    picked = zf.gather(1, y0[:, None]).squeeze(1)
    loss = torch.where(counted, lse - picked, 0.0).sum()
    if not need_grad:
        return loss, None
    # G = softmax(z) - onehot(y): the softmax written once in z's dtype, an ignored row's lse +inf so that its
    # row is 0; the n target entries p_y - 1 computed in fp32 from the picked logits (no cancellation in bf16) and
    # written over it. One temporary [n,V] in fp32 eager (in place), one reduction + one write under compile.
    lse_or_inf = torch.where(counted, lse, float("inf"))
    g = (zf - lse_or_inf[:, None]).exp_().to(z.dtype)
    rows = torch.arange(g.shape[0], device=g.device)
    g[rows, y0] = torch.where(counted, torch.exp(picked - lse) - 1, 0.0).to(g.dtype)
    return loss, g


def _add_gt_h(dw: torch.Tensor, g: torch.Tensor, h: torch.Tensor) -> None:
    """dw += g^T h with dw wider than g and h (fp32 over bf16): on CUDA one GEMM accumulating into dw (cuBLAS's
    beta = 1, ``out_dtype``), elsewhere the product rounded to g's dtype and added."""
    if dw.is_cuda and dw.dtype != g.dtype:
        torch.addmm(dw, g.t(), h, out_dtype=dw.dtype, out=dw)
    else:
        dw += g.t() @ h


class _LinearCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, w, y, chunk, pad):
        need_dh, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        dtype = autocast_dtype(h)  # what autocast would run the head's GEMM in
        V = w.shape[0]
        with torch.autocast(h.device.type, enabled=False):
            hc, wc = h.to(dtype), w.to(dtype)  # the weight cast once for every chunk
            if V % pad:  # zero rows up to a multiple of pad: every GEMM's leading dimension aligned
                wc = torch.cat([wc, wc.new_zeros(-V % pad, wc.shape[1])])
            total = torch.zeros((), dtype=torch.promote_types(dtype, torch.float32), device=h.device)
            dh = torch.empty_like(hc) if need_dh else None
            dw = torch.zeros(wc.shape, dtype=total.dtype, device=w.device) if need_dw else None
            for i in range(0, hc.shape[0], chunk):
                h_i = hc[i:i + chunk]
                loss, g = region("lm_loss", _ce_chunk, h_i, wc, y[i:i + chunk], need_dh or need_dw, V)
                total += loss
                if need_dh:
                    torch.mm(g, wc, out=dh[i:i + chunk])
                if need_dw:
                    _add_gt_h(dw, g, h_i)
        ctx.h_dtype, ctx.w_dtype = h.dtype, w.dtype
        ctx.save_for_backward(dh, dw[:V] if dw is not None else None)
        return total

    @staticmethod
    def backward(ctx, g):
        dh, dw = ctx.saved_tensors
        gh = (dh * g).to(ctx.h_dtype) if dh is not None else None
        gw = (dw * g).to(ctx.w_dtype) if dw is not None else None
        return gh, gw, None, None, None


def linear_ce_sum(h: torch.Tensor, w: torch.Tensor, y: torch.Tensor, chunk: int = 4096,
                  pad_vocab: int | None = None) -> torch.Tensor:
    """Summed cross-entropy (fp32, 0-d) of the logits h @ w.T (h [N,D], w [V,D]) against y [N] (-100 ignored),
    ``chunk`` rows at a time, differentiable in h and w (the gradients computed in the forward). ``pad_vocab``: the
    GEMMs run over V rounded up to a multiple of it (zero rows, logits -inf: the same loss and gradients); default
    64 on CUDA, where a vocabulary such as a small corpus's 18,078-token BPE (rows of 36,156 bytes) otherwise
    makes cuBLAS leave its tensor-core kernels (~3x slower), 1 elsewhere."""
    if h.dim() != 2 or w.dim() != 2 or h.shape[1] != w.shape[1]:
        raise ValueError(f"linear_ce_sum needs h [N,D] and w [V,D]; got {tuple(h.shape)} and {tuple(w.shape)}")
    if y.shape != h.shape[:1]:
        raise ValueError(f"targets must be [N] = [{h.shape[0]}]; got {tuple(y.shape)}")
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1; got {chunk}")
    pad = pad_vocab if pad_vocab is not None else (64 if h.is_cuda else 1)
    if pad < 1:
        raise ValueError(f"pad_vocab must be >= 1; got {pad_vocab}")
    return _LinearCE.apply(h, w, y, chunk, pad)
