"""fla-core's Triton KDA kernels behind our calling convention (GPU only; imported lazily)."""

from __future__ import annotations

import functools

import torch

__all__ = ["FLA_DTYPES", "fla_dtype_error", "fla_available", "fla_chunk_kda", "fla_fused_recurrent_kda",
           "fla_cp_available", "fla_build_cp_context", "fla_chunk_kda_cp"]


@functools.lru_cache(maxsize=1)
def _fla_ops():
    try:
        from fla.ops.kda import chunk_kda, fused_recurrent_kda
    except Exception:  # noqa: BLE001 - any import failure (no triton, no GPU driver) means "not available"
        return None
    return chunk_kda, fused_recurrent_kda


FLA_DTYPES = (torch.bfloat16, torch.float16, torch.float32)  # what fla-core's Triton kernels compute in


def fla_dtype_error(x: torch.Tensor) -> str | None:
    """Why fla-core's kernels cannot take ``x``'s dtype (fp64, integers), or None when they can."""
    if x.dtype in FLA_DTYPES:
        return None
    return (f"fla-core's kernels take bf16, fp16 or fp32 tensors, not {x.dtype}; use the pure-torch reference "
            "(backend='torch') for fp64")


def fla_available(x: torch.Tensor) -> bool:
    """fla-core's kernels can run on ``x``: a CUDA tensor of a dtype they compute in, fla-core importable."""
    return x.is_cuda and fla_dtype_error(x) is None and _fla_ops() is not None


def _require(x: torch.Tensor):
    if (why := fla_dtype_error(x)) is not None:
        raise ValueError(f"backend='fla': {why}")
    if not x.is_cuda:
        raise RuntimeError(f"backend='fla' runs fla-core's Triton kernels on CUDA tensors; these are on {x.device}: "
                           "use backend='torch' (or 'auto') here")
    ops = _fla_ops()
    if ops is None:
        raise RuntimeError("backend='fla' needs fla-core and triton on a CUDA device: pip install 'k3[gpu]'")
    return ops


@functools.lru_cache(maxsize=1)
def _has_static_chunk_list() -> bool:
    import inspect

    return "use_graph" in inspect.signature(_fla_ops()[0]).parameters


def fla_chunk_kda(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                  cu_seqlens=None, lower_bound=None):
    chunk, _ = _require(q)
    # use_graph: fla-core (>= 0.6) builds its list of (document, chunk) pairs on the device in a fixed shape
    # (ceil(T/64) + N - 1 rows, the spare ones skipped by the kernels) instead of reading cu_seqlens back to the host,
    # a wait for every queued kernel in each forward and backward of packed documents
    static = {"use_graph": True} if cu_seqlens is not None and _has_static_chunk_list() else {}
    # safe_gate: the gate is known to stay above lower_bound, which enables fla's M=16 tensor-core tiles
    return chunk(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                 output_final_state=output_final_state, cu_seqlens=cu_seqlens,
                 safe_gate=lower_bound is not None, lower_bound=lower_bound, **static)


def fla_fused_recurrent_kda(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                            cu_seqlens=None, lower_bound=None):
    _, rec = _require(q)
    return rec(q, k, v, g, beta, scale=scale, initial_state=initial_state,
               output_final_state=output_final_state, cu_seqlens=cu_seqlens)


# ---------------------------------------------------------------- fla-core's own context parallelism


@functools.lru_cache(maxsize=1)
def _fla_cp():
    try:
        from fla.ops.cp import build_cp_context
    except Exception:  # noqa: BLE001 - as above: any import failure means "not available"
        return None
    return build_cp_context


def fla_cp_available(x: torch.Tensor) -> bool:
    """fla-core's context parallelism (``fla.ops.cp``) can run on ``x``'s device."""
    return fla_available(x) and _fla_cp() is not None


def fla_build_cp_context(cu_seqlens: torch.Tensor, group):
    """fla's FLACPContext for this rank's equal, contiguous 1/world slice of the packed sequence; ``cu_seqlens``:
    the GLOBAL boundaries (moved to the device by the caller). fla caches the context by the tensor's identity."""
    build = _fla_cp()
    if build is None:
        raise RuntimeError("fla-core's context parallelism (fla.ops.cp) does not import: pip install 'k3[gpu]'")
    return build(cu_seqlens=cu_seqlens, group=group)


def fla_chunk_kda_cp(q, k, v, g, beta, cp_context, scale=None, lower_bound=None):
    """fla's chunk_kda of this rank's slice with its cross-rank state exchange (``cp_context``); returns o only:
    fla supports neither an initial state nor a final state under CP. Same conventions as ``fla_chunk_kda``."""
    chunk, _ = _require(q)
    o, _ = chunk(q, k, v, g, beta, scale=scale, cu_seqlens=cp_context.cu_seqlens, cp_context=cp_context,
                 safe_gate=lower_bound is not None, lower_bound=lower_bound)
    return o
