"""Kimi Delta Attention ops: the pure-torch reference and the fla-core dispatch (see README.md here).

``backend``: "auto" uses fla-core on CUDA when it imports, else the reference; "torch" forces the
reference; "fla" requires fla-core. The environment variable ``K3_KDA_BACKEND`` ("auto", "torch" or "fla", read
at every call) overrides what "auto" resolves to, e.g. ``K3_KDA_BACKEND=torch`` runs the reference on CUDA too.
"""

from __future__ import annotations

import os

import torch

from . import reference
from .fla import fla_available, fla_chunk_kda, fla_fused_recurrent_kda
from .gate import kda_gate, lower_bound_gate, softplus_gate

__all__ = ["chunk_kda", "recurrent_kda", "kda_gate", "lower_bound_gate", "softplus_gate", "resolve_backend",
           "requested_backend"]

BACKENDS = ("auto", "torch", "fla")
BACKEND_ENV = "K3_KDA_BACKEND"  # overrides what backend="auto" resolves to


def requested_backend(backend: str) -> str:
    """``backend`` after the ``K3_KDA_BACKEND`` override of "auto" (read at every call): "auto", "torch" or "fla",
    before any look at the device (the decode, whose kernel needs no fla-core, tells "torch" by request apart
    from "auto" without fla-core)."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown KDA backend {backend!r}; expected one of {BACKENDS}")
    if backend == "auto":
        override = os.environ.get(BACKEND_ENV, "").strip() or "auto"
        if override not in BACKENDS:
            raise ValueError(f"environment variable {BACKEND_ENV}={os.environ[BACKEND_ENV]!r} is not a KDA backend; "
                             f"expected one of {BACKENDS} (or unset)")
        return override
    return backend


def resolve_backend(backend: str, x: torch.Tensor) -> str:
    """The kernels ``backend`` means for tensors like ``x``: "torch" or "fla". For "auto", ``K3_KDA_BACKEND``
    (read at every call) decides when set to "torch" or "fla"; unset, empty or "auto": fla-core on CUDA when it
    imports, else the reference."""
    backend = requested_backend(backend)
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
