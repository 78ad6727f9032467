"""MTP on the ("dp", "cp") mesh (k3.distributed.mesh.DataContextParallelTraining) against one process.

(1) in-process, 4 gloo ranks (dp 2 x cp 2), the tiny model with its MTP layer: the logged lm and MTP losses, every
parameter gradient after ``reduce_grads`` (FSDP shards gathered) and the global gradient norm equal one process's
on the same global batch; (2) ``torchrun --nproc_per_node 4 -m k3 train --dp 2 --cp 2`` at the default MTP weight
reproduces the single-process loss curve (lm and MTP losses, gradient norm) at the same global batch.
"""

import copy

import pytest
import torch

from .gloo import needs_backend, spawn, test_device
from .runs import ONE, assert_curves_match, torchrun, train_run as _run
from .test_mesh_ep import VOCAB, full, reference
from tests.conftest import assert_close

TOL = 1e-5


def global_batch() -> dict:
    """2 dp slices of 64 tokens; documents cross the cp cut of both slices, none crosses a slice. The second slice's
    short documents make the slices' shares of next-token (61 : 57) and MTP targets (58 : 50) differ."""
    torch.manual_seed(1)
    cu = torch.tensor([0, 9, 41, 64, 66, 68, 70, 72, 74, 100, 128])
    return {"input_ids": torch.randint(0, VOCAB, (1, 128)), "cu_seqlens": cu}


def _check_gradients(rank, world):
    import os

    from k3.distributed.mesh import DataContextParallelTraining

    os.environ["WORLD_SIZE"] = str(world)  # init_from_env reads it; the process group is already up
    batch, w = global_batch(), 0.3
    model, ref, ref_grads = reference(batch, w)
    assert len(model.mtp) == 1
    untouched = copy.deepcopy(model)
    par = DataContextParallelTraining(2, 2)
    par.shard(model)
    loss, lm, mtp, n = par.loss(model, batch, w, test_device(rank))
    loss.backward()
    par.reduce_grads(model)
    assert n == batch["input_ids"].numel()
    assert lm == pytest.approx(ref["lm_loss"].item(), rel=1e-6) and mtp == pytest.approx(ref["mtp_loss"].item(), rel=1e-6)
    grads = {name: full(p.grad) for name, p in model.named_parameters() if p.grad is not None}
    assert set(grads) == set(ref_grads) and any(k.startswith("mtp.") for k in grads)
    for name, g in grads.items():
        assert_close(f"rank {rank} grad {name}", ref_grads[name], g, TOL)
    norm = full(torch.nn.utils.get_total_norm([p.grad for p in model.parameters() if p.grad is not None]))
    assert float(norm) == pytest.approx(float(torch.nn.utils.get_total_norm(list(ref_grads.values()))), rel=1e-6)
    # a second step runs through the registered forward method again (FSDP's per-iteration state is reset)
    model.zero_grad(set_to_none=True)
    par.loss(model, batch, w, test_device(rank))[0].backward()
    par.reduce_grads(model)
    for name, p in model.named_parameters():
        if p.grad is not None:
            assert_close(f"rank {rank} step-2 grad {name}", ref_grads[name], full(p.grad), TOL)
    state, ref_state = par.full_state(model), untouched.state_dict()  # rank 0's (the writer's), tied weights once
    assert (len(state) > 0) == (rank == 0) and all(torch.equal(v, ref_state[k]) for k, v in state.items())


@pytest.mark.distributed
@needs_backend(4)
def test_dp2_x_cp2_with_mtp_gradients_equal_one_process(tmp_path):
    spawn(_check_gradients, 4, tmp_path)


@pytest.mark.distributed
@needs_backend(4)
def test_dp2_x_cp2_with_mtp_reproduces_the_single_process_loss_curve(tmp_path):
    """4 processes, the tiny preset's MTP layer at the default weight: FSDP2 over "dp", each dp slice's
    sequences split along time over "cp" (trunk and MTP layer)."""
    single = _run(ONE + ["--batch-size", "4"], tmp_path / "one")
    mesh = _run(torchrun(4) + ["--batch-size", "2", "--dp", "2", "--cp", "2"], tmp_path / "mesh")
    assert all("mtp_loss" in r for r in single + mesh)
    assert_curves_match(single, mesh)  # stated tolerance 1e-5 relative on CPU (measured <= 2e-7)
