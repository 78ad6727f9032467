"""Attention Residuals over depth (SPEC §3): softmax mixing of earlier sources by a learned pseudo-query.

Legend: S sources, Q pseudo-queries, D hidden, * any leading token dims. A pseudo-query's logit for source v
is w . (RMSNorm(v) * norm_weight); the softmax over sources runs in fp32.
"""

from __future__ import annotations

import torch

from ._triton import triton_available
from .norms import rms_norm
from .precision import upcast

__all__ = ["attn_res_logits", "attn_res_mix", "attn_res_partial", "attn_res_merge", "attn_res_mix_norm",
           "attn_res_add_mix_norm", "attn_res_mix_norm_reference", "attn_res_mix_norm_triton", "SourceGrad",
           "seal_source"]


def _unit_rms(v: torch.Tensor, eps: float) -> torch.Tensor:
    vf = upcast(v)
    return vf * torch.rsqrt(vf.pow(2).mean(-1, keepdim=True) + eps)


def attn_res_logits(sources: torch.Tensor, query: torch.Tensor, norm_weight: torch.Tensor, eps: float = 1e-5):
    """sources [S,*,D], query/norm_weight [D] -> logits [S,*] in fp32 (also under autocast, which would run the
    product in bf16)."""
    with torch.autocast(sources.device.type, enabled=False):
        return _unit_rms(sources, eps) @ (upcast(query) * upcast(norm_weight))


def attn_res_mix(sources: torch.Tensor, query: torch.Tensor, norm_weight: torch.Tensor, eps: float = 1e-5):
    """h = sum_i softmax_i(logit_i) v_i over sources [S,*,D] -> [*,D] (in the sources' dtype)."""
    w = attn_res_logits(sources, query, norm_weight, eps).softmax(0)  # [S,*]
    return (w.unsqueeze(-1) * upcast(sources)).sum(0).to(sources.dtype)


def attn_res_partial(blocks: torch.Tensor, queries: torch.Tensor, norm_weights: torch.Tensor, eps: float = 1e-5):
    """Mix completed blocks [S,*,D] for Q pseudo-queries at once (one pass over the blocks).

    Returns (o [Q,*,D] fp32, lse [Q,*] fp32), to be merged with each layer's running partial sum.
    """
    keys = _unit_rms(blocks, eps)  # [S,*,D], shared by every pseudo-query
    logits = torch.einsum("s...d,qd->qs...", keys, upcast(queries) * upcast(norm_weights))  # [Q,S,*]
    lse = logits.logsumexp(1)
    o = torch.einsum("qs...,s...d->q...d", (logits - lse.unsqueeze(1)).exp(), upcast(blocks))
    return o, lse


def attn_res_merge(o1, lse1, partial, query, norm_weight, eps: float = 1e-5):
    """Online-softmax merge of the completed-block mix (o1, lse1) with one more source, the partial sum:
    h = o1 + sigmoid(l2 - lse1) (partial - o1), l2 = the partial's logit."""
    l2 = attn_res_logits(partial, query, norm_weight, eps)
    return (o1 + torch.sigmoid(l2 - lse1).unsqueeze(-1) * (upcast(partial) - o1)).to(partial.dtype)


def attn_res_mix_norm_reference(sources: list[torch.Tensor], query: torch.Tensor, key_norm_weight: torch.Tensor,
                                eps: float, norm_weight: torch.Tensor | None = None, norm_eps: float = 1e-5):
    """A sub-layer's input: the mix of ``sources`` (S tensors [*,D]) by ``query``, then, with ``norm_weight``, the
    sub-layer's pre-norm RMSNorm(h) * norm_weight over h rounded to the sources' dtype. -> [*,D]."""
    h = attn_res_mix(torch.stack(sources), query, key_norm_weight, eps)
    return h if norm_weight is None else rms_norm(h, norm_weight, norm_eps)


class SourceGrad:
    """The gradient of one depth source that many mixes read (a sealed AttnRes block: every later sub-layer's mix
    reads it), summed in ONE buffer that each mix's backward kernel adds into, instead of each mix returning its own
    gradient and autograd adding them (a pass that reads two [N,D] tensors and writes one, per mix and block).
    ``seal_source`` puts the node in front of the source that hands the sum to autograd once every mix is done."""

    __slots__ = ("grad",)

    def __init__(self):
        self.grad: torch.Tensor | None = None  # [N,D] contiguous, the sum so far (None before the first mix's)


class _Seal(torch.autograd.Function):
    """Identity on a depth source; its backward runs after every reader's (they read its output) and returns the
    gradient they summed into the ``SourceGrad`` plus whatever reached it through autograd (readers without the
    kernel)."""

    @staticmethod
    def forward(ctx, x, sink: SourceGrad):
        ctx.sink, ctx.shape = sink, x.shape
        ctx.set_materialize_grads(False)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        total, ctx.sink.grad = ctx.sink.grad, None
        if total is None:
            return g, None
        total = total.view(ctx.shape)
        return (total if g is None else total + g), None


def seal_source(x: torch.Tensor) -> tuple[torch.Tensor, SourceGrad | None]:
    """(x as a source whose readers' gradients are summed in place, its SourceGrad), or (x, None) where nothing
    will differentiate it."""
    if not (torch.is_grad_enabled() and x.requires_grad):
        return x, None
    sink = SourceGrad()
    return _Seal.apply(x, sink), sink


class _MixNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, query, key_norm_weight, norm_weight, eps: float, norm_eps: float, sinks, *sources):
        from . import _attn_res_triton as k

        shape = sources[0].shape
        flat = [x.reshape(-1, shape[-1]).contiguous() for x in sources]
        u = (query.float() * key_norm_weight.float()).contiguous()
        nw = norm_weight.float().contiguous() if norm_weight is not None else None
        out, stats, r2 = k.forward(flat, u, nw, eps, norm_eps)
        ctx.save_for_backward(query, key_norm_weight, norm_weight, stats, r2, *flat)
        ctx.shape, ctx.sinks = shape, sinks or (None,) * len(sources)
        return out.view(shape)

    @staticmethod
    def backward(ctx, dy):
        from . import _attn_res_triton as k

        query, key_norm_weight, norm_weight, stats, r2, *flat = ctx.saved_tensors
        u = (query.float() * key_norm_weight.float()).contiguous()
        nw = norm_weight.float().contiguous() if norm_weight is not None else None
        into = [sink.grad if sink is not None else None for sink in ctx.sinks]
        grads, du, dnw = k.backward(dy.reshape(-1, ctx.shape[-1]), flat, u, nw, stats, r2, into=into)
        for sink, g in zip(ctx.sinks, grads):
            if sink is not None:
                sink.grad = g  # summed there; handed to autograd by the source's _Seal
        d_query = (du * key_norm_weight.float()).to(query.dtype)  # u = query * key_norm_weight
        d_key_norm = (du * query.float()).to(key_norm_weight.dtype)
        d_norm = dnw.to(norm_weight.dtype) if norm_weight is not None else None
        return (d_query, d_key_norm, d_norm, None, None, None,
                *(None if sink is not None else g.view(ctx.shape) for sink, g in zip(ctx.sinks, grads)))


@torch.compiler.disable  # opaque to torch.compile: a compiled region calls the kernels as they are
def attn_res_mix_norm_triton(sources: list[torch.Tensor], query: torch.Tensor, key_norm_weight: torch.Tensor,
                             eps: float, norm_weight: torch.Tensor | None = None, norm_eps: float = 1e-5,
                             sinks: tuple[SourceGrad | None, ...] | None = None):
    """``attn_res_mix_norm_reference`` as Triton kernels, forward and backward (``k3.ops._attn_res_triton``).

    Forward, one program per block of rows: a pass over the sources for each one's sum of squares and dot with
    u = query * key_norm_weight (logit_s = r_s (v_s . u), r_s = rsqrt(mean(v_s^2) + eps)), the softmax over sources
    in registers, a second pass writing h = sum_s a_s v_s (rounded), and with the pre-norm a third over h. Only
    per-row statistics (a_s, r_s, v_s . u and the norm's inverse RMS) are kept for the backward; h is recomputed.
    Backward, with dh the gradient at h (through the norm: dh = r2 w dy - h r2^3 (h . w dy) / D):
        da_s = v_s . dh,  dl_s = a_s (da_s - sum_t a_t da_t),
        dv_s = a_s dh + dl_s r_s u - dl_s r_s^3 (v_s . u) v_s / D,   du = sum_rows sum_s dl_s r_s v_s,
    one kernel over rows for the dl_s (and the norm's row sum), one over D tiles x row groups for the dv_s and the
    weight gradients (partial sums per group, added up after). Each source is read in place (no stack). ``sinks``:
    per source a ``SourceGrad`` (from ``seal_source``) that its dv_s is added into, in the kernel, or None."""
    return _MixNorm.apply(query, key_norm_weight, norm_weight, eps, norm_eps, sinks, *sources)


KERNEL_MIN_ROWS = 1024


def attn_res_mix_norm(sources: list[torch.Tensor], query: torch.Tensor, key_norm_weight: torch.Tensor, eps: float,
                      norm_weight: torch.Tensor | None = None, norm_eps: float = 1e-5,
                      sinks: tuple[SourceGrad | None, ...] | None = None):
    """Same arguments and result as ``attn_res_mix_norm_reference`` (``sinks``: the Triton backward's in-place sums,
    ``attn_res_mix_norm_triton``; ignored elsewhere, where autograd sums); where it runs:
    - inference on CUDA (no gradient, Triton importable, up to 12 sources of one dtype and shape): one Triton kernel
      per call, one program per row (``_rows``; a decode step's 24 mixes are 24 launches);
    - training on CUDA with at least ``KERNEL_MIN_ROWS`` rows: the Triton forward and backward
      (``attn_res_mix_norm_triton``);
    - elsewhere the reference (CPU; a few rows with gradients, where ``torch.compile`` fuses it)."""
    if not uses_kernel(sources):
        return attn_res_mix_norm_reference(sources, query, key_norm_weight, eps, norm_weight, norm_eps)
    if not torch.is_grad_enabled():
        return _rows(sources, None, query, key_norm_weight, eps, norm_weight, norm_eps)[0]
    return attn_res_mix_norm_triton(sources, query, key_norm_weight, eps, norm_weight, norm_eps, sinks)


def uses_kernel(sources: list[torch.Tensor]) -> bool:
    """``attn_res_mix_norm`` runs a Triton kernel for these sources (else the reference)."""
    return kernel_applies(sources) and (not torch.is_grad_enabled()
                                        or sources[0].numel() >= KERNEL_MIN_ROWS * sources[0].shape[-1])


def attn_res_add_mix_norm(sources: list[torch.Tensor], delta: torch.Tensor, query: torch.Tensor,
                          key_norm_weight: torch.Tensor, eps: float, norm_weight: torch.Tensor | None = None,
                          norm_eps: float = 1e-5) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual add of the sub-layer before, then the mix: last = sources[-1] + delta replaces the last source
    (the partial sum), -> (attn_res_mix_norm(sources[:-1] + [last], ...), last). In inference on CUDA the add is
    done inside the mix's kernel (one launch, the partial sum read once); elsewhere it is the add, then
    ``attn_res_mix_norm``."""
    last = sources[-1]
    if not torch.is_grad_enabled() and delta.dtype == last.dtype and delta.shape == last.shape and \
            kernel_applies(sources):
        return _rows(sources, delta, query, key_norm_weight, eps, norm_weight, norm_eps)
    last = last + delta
    return attn_res_mix_norm(sources[:-1] + [last], query, key_norm_weight, eps, norm_weight, norm_eps), last


def kernel_applies(sources: list[torch.Tensor]) -> bool:
    """The Triton kernels take these sources: CUDA, Triton importable, up to 12 of one dtype and shape."""
    x = sources[0]
    return x.is_cuda and triton_available() and _fits(sources)


def _fits(sources) -> bool:
    x = sources[0]
    return (len(sources) <= 12 and x.dtype in (torch.bfloat16, torch.float16, torch.float32)
            and all(s.dtype == x.dtype and s.shape == x.shape for s in sources))


def _rows(sources, delta, query, key_norm_weight, eps, norm_weight, norm_eps):
    shape = sources[0].shape
    out, last = torch.ops.k3.attn_res_rows([s.reshape(-1, shape[-1]) for s in sources],
                                           delta.reshape(-1, shape[-1]) if delta is not None else None, query,
                                           key_norm_weight, norm_weight, float(eps), float(norm_eps))
    return out.view(shape), (last.view(shape) if delta is not None else None)


@torch.library.custom_op("k3::attn_res_rows", mutates_args=())
def _attn_res_rows(sources: list[torch.Tensor], delta: torch.Tensor | None, query: torch.Tensor,
                   key_norm_weight: torch.Tensor, norm_weight: torch.Tensor | None, eps: float,
                   norm_eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Inference (no autograd formula): ``_attn_res_triton.rows`` as an op opaque to torch.compile, so a compiled
    decode step calls the one kernel instead of the reference's fused pieces. Returns (out, new last source;
    an empty tensor without ``delta``)."""
    from . import _attn_res_triton as k

    out, last = k.rows([s.contiguous() for s in sources], delta.contiguous() if delta is not None else None,
                       query.contiguous(), key_norm_weight.contiguous(),
                       norm_weight.contiguous() if norm_weight is not None else None, eps, norm_eps)
    return out, (last if last is not None else out.new_empty(0))


@_attn_res_rows.register_fake
def _(sources, delta, query, key_norm_weight, norm_weight, eps, norm_eps):
    x = sources[0]
    return torch.empty_like(x), (torch.empty_like(x) if delta is not None else x.new_empty(0))
