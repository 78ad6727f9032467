"""Causal depthwise short convolution with a decode state (KDA's q/k/v ShortConv, SPEC §2.1).

Legend: B batch, T time, D channels, W kernel width, N sequences. weight [D, 1, W] (nn.Conv1d layout);
state [N, D, W-1] holds the last W-1 inputs of each sequence, oldest first.

Three implementations of one function: the pure-torch reference below (CPU, and CUDA with ``backend="torch"``);
on CUDA (``backend`` "fla", or "auto" where fla-core imports: the KDA layer's ``k3.ops.kda.resolve_backend``) k3's
Triton kernels for the stateless convolution without activation that training runs (``k3.ops._short_conv_triton``:
one pass forward, one backward that reads dy and x once per tap from cache and sums the weight's gradient per
tile), and fla-core's ``causal_conv1d`` for every call with a state in or out or the SiLU (prefill, context
parallelism's halo). fla keeps a state of W entries per channel, the oldest unused: ours is its last W-1.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from ._triton import triton_available
from .varlen import _to_device, cached_plan, check_cu_seqlens, document_offsets, document_starts

__all__ = ["short_conv"]

FLA_CHUNK = 64  # fla's causal_conv1d time tile: its (document, tile) list is planned per cu_seqlens


def short_conv(
    x: torch.Tensor,
    weight: torch.Tensor,
    state: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    output_final_state: bool = False,
    activation: bool = True,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """y_t = act(sum_i w_i x_{t-W+1+i}); never looks across a document boundary of ``cu_seqlens``.

    x [B,T,D] (B = 1 when packed). Returns (y [B,T,D], final state [N,D,W-1] or None). ``backend``: "auto",
    "torch" (the reference) or "fla", as KDA's.
    """
    from .kda import resolve_backend

    D, W = weight.shape[0], weight.shape[-1]
    if x.shape[-1] != D:
        raise ValueError(f"short_conv: x has {x.shape[-1]} channels, weight has {D}")
    if resolve_backend(backend, x) == "fla" and x.shape[1] > 0:
        if state is None and not output_final_state and not activation and triton_available():
            return _triton(x, weight, cu_seqlens), None
        return _fla(x, weight, state, cu_seqlens, output_final_state, activation)
    if cu_seqlens is not None:
        return _packed(x, weight, state, cu_seqlens, output_final_state, activation)
    N, T, _ = x.shape
    if state is None:
        state = x.new_zeros(N, D, W - 1)
    elif state.shape != (N, D, W - 1):
        raise ValueError(f"short_conv state must be [N,D,W-1] = [{N},{D},{W - 1}]; got {tuple(state.shape)}")
    xt = torch.cat([state.to(x.dtype), x.transpose(1, 2)], dim=-1)  # [N, D, W-1+T]
    y = F.conv1d(xt, weight.to(x.dtype).view(D, 1, W), groups=D).transpose(1, 2)  # [N, T, D]
    if activation:
        y = F.silu(y)
    final = None
    if output_final_state:
        final = xt[..., -(W - 1):] if W > 1 else xt[..., :0]
    return y, final


def _packed(x, weight, state, cu_seqlens, output_final_state, activation):
    """Packed documents [1,T,D] without padding: the W taps as shifted copies of the row, each masked where it
    would reach into the previous document (there the document's initial state, if any, supplies the input).
    Every index is distinct or small (no gather from one position), cu_seqlens is read back once per tensor
    (``cached_plan``, shared with the other layers), and the work is W passes over the T real tokens, however the
    documents are cut. Sums in fp32 (fp64 for fp64)."""
    B, T, D = x.shape
    W = weight.shape[-1]
    if B != 1:
        raise ValueError(f"packed documents (cu_seqlens) come in batch 1; got batch {B}")
    N = cu_seqlens.numel() - 1
    if state is not None and state.shape != (N, D, W - 1):
        raise ValueError(f"short_conv state must be [N,D,W-1] = [{N},{D},{W - 1}] (N = number of documents); "
                         f"got {tuple(state.shape)}")
    if T == 0:  # nothing to convolve: every (empty) document keeps its state
        final = (state if state is not None else x.new_zeros(N, D, W - 1)) if output_final_state else None
        return x, final
    acc = torch.promote_types(x.dtype, torch.float32)
    # every token's offset in its document, built once per cu_seqlens tensor (3 convolutions per KDA layer)
    rel, starts, lens = cached_plan(cu_seqlens, ("offsets", x.device), lambda cu: _offsets(cu, T, x.device))
    xs, w = x[0].to(acc), weight.view(D, W).to(acc)
    hist = state.to(acc).transpose(1, 2) if state is not None else None  # [N,W-1,D], oldest first
    y = xs * w[:, W - 1]  # tap j looks j tokens back, with weight w[:, W-1-j]
    for j in range(1, W):
        shifted = F.pad(xs, (0, 0, j, 0))[:T] * (rel >= j)[:, None].to(acc)  # x_{t-j} within the document
        if hist is not None:  # the first j tokens of every document reach back into its state
            r = torch.arange(j, device=x.device)
            dest = (starts[:, None] + r).clamp(max=T - 1).flatten()  # [N*j]
            keep = (r < lens[:, None]).to(acc)[..., None]  # [N,j,1]: a document shorter than r has no token r
            shifted = shifted.index_add(0, dest, (hist[:, W - 1 - j:] * keep).flatten(0, 1))
        y = y + shifted * w[:, W - 1 - j]
    if activation:
        y = F.silu(y)
    final = None
    if output_final_state:  # per document its last W-1 inputs, oldest first: from x, or from its state before it
        m = torch.arange(W - 1, device=x.device)
        pos = (starts + lens)[:, None] - (W - 1) + m  # [N,W-1]
        inside = (pos >= starts[:, None]).to(acc)[..., None]
        final = xs[pos.clamp(min=0, max=T - 1)] * inside
        if hist is not None:
            final = final + hist.gather(1, (lens[:, None] + m).clamp(max=max(W - 2, 0))[..., None].expand(
                -1, -1, D)) * (1 - inside)
        final = final.transpose(1, 2).to(x.dtype)
    return y.to(x.dtype)[None], final


class _Conv(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, starts, seg: int):
        from . import _short_conv_triton as k

        w = weight.view(weight.shape[0], -1).float().contiguous()
        y = k.forward(x, w, starts, seg)
        ctx.save_for_backward(x, w, starts)
        ctx.seg, ctx.wshape, ctx.wdtype = seg, weight.shape, weight.dtype
        return y

    @staticmethod
    def backward(ctx, dy):
        from . import _short_conv_triton as k

        x, w, starts = ctx.saved_tensors
        dx, dw = k.backward(dy if dy.stride(-1) == 1 else dy.contiguous(), x, w, starts, ctx.seg)
        return dx, dw.to(ctx.wdtype).view(ctx.wshape), None, None


def _triton(x, weight, cu_seqlens):
    """The stateless convolution without activation through k3's kernels: x [B,T,D] (channels contiguous; a view
    of a wider row is read in place) -> y [B,T,D]. Packed documents find their starts in ``document_starts`` (one
    plan per cu_seqlens, a CUDA graph's own buffer); a batch of rows is one packed row of B documents of T."""
    B, T, D = x.shape
    if cu_seqlens is not None:
        if B != 1:
            raise ValueError(f"packed documents (cu_seqlens) come in batch 1; got batch {B}")
        starts = document_starts(cu_seqlens, x.device)
        if starts.numel() != T:
            raise ValueError(f"short_conv: cu_seqlens covers {starts.numel()} tokens; x has {T}")
    else:
        starts = None
    flat = x.reshape(B * T, D) if x.stride(-1) == 1 else x.reshape(B * T, D).contiguous()
    return _Conv.apply(flat, weight, starts, T).view(B, T, D)


@functools.lru_cache(maxsize=1)
def _fla_conv():
    try:
        from fla.modules.causal_conv1d import causal_conv1d
    except Exception:  # noqa: BLE001 - any import failure (no triton, no GPU driver) means "not available"
        return None
    return causal_conv1d


def _fla(x, weight, state, cu_seqlens, output_final_state, activation):
    """fla-core's kernel. Its state has W entries per channel and reads only the last W-1 (ours): a zero column in
    front, dropped from its final state. Its (document, tile) list comes from ``cached_plan``: one pinned copy per
    cu_seqlens tensor, no read-back of the device's cu_seqlens in any layer's forward or backward."""
    from .kda.fla import _require

    _require(x)  # CUDA tensor of a dtype fla computes in, fla importable: else a clear error
    conv = _fla_conv()
    if conv is None:
        raise RuntimeError("backend='fla' needs fla-core's causal_conv1d (fla.modules.causal_conv1d)")
    D, W = weight.shape[0], weight.shape[-1]
    B, T, _ = x.shape
    N = B if cu_seqlens is None else cu_seqlens.numel() - 1
    if state is not None and state.shape != (N, D, W - 1):
        raise ValueError(f"short_conv state must be [N,D,W-1] = [{N},{D},{W - 1}]; got {tuple(state.shape)}")
    if cu_seqlens is not None and B != 1:
        raise ValueError(f"packed documents (cu_seqlens) come in batch 1; got batch {B}")
    kw = {}
    if cu_seqlens is not None:
        kw["chunk_indices"] = cached_plan(cu_seqlens, ("fla_conv_tiles", x.device),
                                          lambda cu: _fla_tiles(cu, T, x.device))
    h0 = F.pad(state, (1, 0)).to(x.dtype) if state is not None else None
    y, final = conv(x.contiguous(), weight.view(D, W), initial_state=h0, output_final_state=output_final_state,
                    activation="silu" if activation else None, cu_seqlens=cu_seqlens, **kw)
    return y, (final[..., 1:].to(x.dtype) if final is not None else None)


def _fla_tiles(cu, T, device):
    """[tiles, 2] (document, tile within it) for fla's varlen kernels, from host cu_seqlens."""
    check_cu_seqlens(cu, T, "short_conv: ")
    pairs = [(n, i) for n, (a, b) in enumerate(zip(cu, cu[1:])) for i in range(-(-(b - a) // FLA_CHUNK))]
    return _to_device([torch.tensor(pairs, dtype=torch.long).view(-1, 2)], device)[0]


def _offsets(cu, T, device):
    check_cu_seqlens(cu, T, "short_conv: ")
    return document_offsets(cu, device)
