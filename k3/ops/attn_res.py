"""Attention Residuals over depth (SPEC §3): softmax mixing of earlier sources by a learned pseudo-query.

Legend: S sources, Q pseudo-queries, D hidden, * any leading token dims. A pseudo-query's logit for source v
is w . (RMSNorm(v) * norm_weight); the softmax over sources runs in fp32.
"""

from __future__ import annotations

import torch

from .precision import upcast

__all__ = ["attn_res_logits", "attn_res_mix", "attn_res_partial", "attn_res_merge"]


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
