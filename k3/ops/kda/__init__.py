"""Kimi Delta Attention ops: the pure-torch reference and the fla-core dispatch (see README.md here).

``backend``: "auto" uses fla-core on CUDA when it imports, else the reference; "torch" forces the
reference; "fla" requires fla-core.
"""

from __future__ import annotations

import torch

from . import reference
from .fla import fla_available, fla_chunk_kda, fla_fused_recurrent_kda
from .gate import kda_gate, lower_bound_gate, softplus_gate

__all__ = ["chunk_kda", "recurrent_kda", "kda_gate", "lower_bound_gate", "softplus_gate", "resolve_backend"]

BACKENDS = ("auto", "torch", "fla")


def resolve_backend(backend: str, x: torch.Tensor) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"unknown KDA backend {backend!r}; expected one of {BACKENDS}")
    if backend == "auto":
        return "fla" if fla_available(x) else "torch"
    return backend


def chunk_kda(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
              cu_seqlens=None, lower_bound=None, backend="auto"):
    """Chunkwise KDA for prefill and training. ``lower_bound``: the gate's floor if known (-5 in K3)."""
    if resolve_backend(backend, q) == "fla":
        return fla_chunk_kda(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, lower_bound)
    return reference.chunk_kda(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens)


def recurrent_kda(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                  cu_seqlens=None, lower_bound=None, backend="auto"):
    """Token-by-token KDA for decode."""
    if resolve_backend(backend, q) == "fla":
        return fla_fused_recurrent_kda(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens)
    return reference.recurrent_kda(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens)
