"""The GLOBAL context-parallel interface (``cp_chunk_kda``): global cu_seqlens, equal contiguous split across ranks.

impl="k3" (``cp_chunk_kda``) against single-process chunk_kda on the whole packed sequence, on 2 gloo ranks:
outputs and input gradients, documents crossing the rank cut, starting exactly at it, or spanning everything.
impl="fla" needs fla-core on CUDA: here (CPU) it must raise a clear error; tests/gpu/test_fla_cp.py runs it.
Legend: T time, H heads, K key dim, V value dim, C chunk size.
"""

import pytest
import torch

from k3.distributed.kcp import cp_chunk_kda, equal_split
from k3.ops.kda.reference import chunk_kda

from .gloo import needs_gloo, spawn
from .test_kcp import C, H, V, long_memory_inputs
from tests.conftest import assert_close

T = 128  # 64 tokens per rank on 2 ranks
# global layouts: one document over both ranks; a document crossing the cut; a document starting exactly at the
# cut (rank 1's piece 0 does not continue); several documents on rank 0 then one crossing and filling rank 1
LAYOUTS = [None, [0, 30, 100, 128], [0, 64, 100, 128], [0, 10, 20, 70, 128]]


# ---------------------------------------------------------------- single process (no process group needed)


def test_equal_split():
    assert [equal_split(128, 4, r) for r in range(4)] == [(0, 32), (32, 64), (64, 96), (96, 128)]
    with pytest.raises(ValueError, match="multiple of the 3 ranks"):
        equal_split(128, 3, 0)
    with pytest.raises(ValueError, match="not one of"):
        equal_split(128, 2, 2)


def test_fla_impl_on_cpu_raises_a_clear_error():
    xs = long_memory_inputs(1, 16)
    with pytest.raises(RuntimeError, match=r"fla-core .* CUDA .*cp_chunk_kda\(impl='k3'\)"):
        cp_chunk_kda(*xs, torch.tensor([0, 16]), impl="fla")


def test_global_interface_input_errors_need_no_process_group():
    q, k, v, g, beta = long_memory_inputs(1, 16)
    cu = torch.tensor([0, 16])
    with pytest.raises(ValueError, match="batch 1"):
        cp_chunk_kda(*long_memory_inputs(2, 16), cu)
    with pytest.raises(ValueError, match="v must be"):
        cp_chunk_kda(q, k, v[:, :8], g, beta, cu)
    with pytest.raises(ValueError, match="same shape"):
        cp_chunk_kda(q, k[..., :4], v, g, beta, cu)
    with pytest.raises(ValueError, match="beta must be"):
        cp_chunk_kda(q, k, v, g, beta[..., :1], cu)
    with pytest.raises(ValueError, match="strictly increase"):
        cp_chunk_kda(q, k, v, g, beta, torch.tensor([0, 8, 8, 16]))
    with pytest.raises(ValueError, match="unknown CP implementation"):
        cp_chunk_kda(q, k, v, g, beta, cu, impl="nccl")
    with pytest.raises(ValueError, match="apply to impl='k3' only"):
        cp_chunk_kda(q, k, v, g, beta, cu, impl="fla", backend="torch")
    with pytest.raises(RuntimeError, match="initialized torch.distributed"):
        cp_chunk_kda(q, k, v, g, beta, cu)


# ---------------------------------------------------------------- multi-process (gloo)


def _check_global(rank, world):
    start, end = equal_split(T, world, rank)
    for i, layout in enumerate(LAYOUTS):
        torch.manual_seed(3)
        inputs = long_memory_inputs(1, T)
        do = torch.randn(1, T, H, V, dtype=torch.float64)
        cu = None if layout is None else torch.tensor(layout)
        scale = 0.3 if i == 1 else None  # the scale reaches the local kernels
        xs_ref = [x.clone().requires_grad_() for x in inputs]
        o_ref, _ = chunk_kda(*xs_ref, scale=scale, cu_seqlens=cu, chunk_size=C)
        (o_ref * do).sum().backward()
        xs = [x[:, start:end].clone().requires_grad_() for x in inputs]
        # the dispatcher and the direct call are the same path; exercise both
        if i % 2:
            o = cp_chunk_kda(*xs, cu, scale=scale, impl="k3", backend="torch", chunk_size=C)
        else:
            o = cp_chunk_kda(*xs, cu_seqlens=cu, scale=scale, backend="torch", chunk_size=C)
        (o * do[:, start:end]).sum().backward()
        assert_close(f"rank {rank} o {layout}", o_ref[:, start:end], o, 1e-9)
        # the tokens next to the cut are the ones the carried state (forward) and its adjoint (backward) reach
        near = slice(0, 16) if rank else slice(-16, None)
        assert_close(f"rank {rank} o near the cut {layout}", o_ref[:, start:end][:, near], o[:, near], 1e-9)
        for name, x_ref, x in zip(["dq", "dk", "dv", "dg", "dbeta"], xs_ref, xs):
            assert_close(f"rank {rank} {name} {layout}", x_ref.grad[:, start:end], x.grad, 1e-9)
            assert_close(f"rank {rank} {name} near the cut {layout}", x_ref.grad[:, start:end][:, near],
                         x.grad[:, near], 1e-9)
    # errors that need the group's size: raised on every rank before any collective
    xs = [x[:, start:end] for x in long_memory_inputs(1, T)]
    with pytest.raises(ValueError, match="multiple of the 2 ranks"):
        cp_chunk_kda(*xs, torch.tensor([0, 50, 127]))
    with pytest.raises(ValueError, match="its own 32-token slice"):
        cp_chunk_kda(*xs, torch.tensor([0, 64]))
    with pytest.raises(RuntimeError, match=r"cp_chunk_kda\(impl='k3'\)"):
        cp_chunk_kda(*xs, torch.tensor([0, T]), impl="fla")


@pytest.mark.slow
@pytest.mark.distributed
@needs_gloo
def test_kcp_global_interface_matches_single_process(tmp_path):
    """impl="k3" behind the global interface, 2 ranks: outputs and all input gradients, every layout of LAYOUTS."""
    spawn(_check_global, 2, tmp_path)
