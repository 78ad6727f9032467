"""fla-core's Triton KDA kernels behind our calling convention (GPU only; imported lazily)."""

from __future__ import annotations

import functools

import torch

__all__ = ["fla_available", "fla_chunk_kda", "fla_fused_recurrent_kda"]


@functools.lru_cache(maxsize=1)
def _fla_ops():
    try:
        from fla.ops.kda import chunk_kda, fused_recurrent_kda
    except Exception:  # noqa: BLE001 - any import failure (no triton, no GPU driver) means "not available"
        return None
    return chunk_kda, fused_recurrent_kda


def fla_available(x: torch.Tensor) -> bool:
    return x.is_cuda and _fla_ops() is not None


def _require():
    ops = _fla_ops()
    if ops is None:
        raise RuntimeError("backend='fla' needs fla-core and triton on a CUDA device: pip install 'k3[gpu]'")
    return ops


def fla_chunk_kda(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                  cu_seqlens=None, lower_bound=None):
    chunk, _ = _require()
    # safe_gate: the gate is known to stay above lower_bound, which enables fla's M=16 tensor-core tiles
    return chunk(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                 output_final_state=output_final_state, cu_seqlens=cu_seqlens,
                 safe_gate=lower_bound is not None, lower_bound=lower_bound)


def fla_fused_recurrent_kda(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                            cu_seqlens=None, lower_bound=None):
    _, rec = _require()
    return rec(q, k, v, g, beta, scale=scale, initial_state=initial_state,
               output_final_state=output_final_state, cu_seqlens=cu_seqlens)
