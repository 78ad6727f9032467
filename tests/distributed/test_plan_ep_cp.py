"""`--ep E --cp C` (and `--dp D --ep E --cp C`) on the ("dp", "ep", "cp") mesh (k3.distributed.plan.ParallelPlan)
against one process.

(1) in-process, 4 gloo ranks (ep 2 x cp 2, dp 1), the tiny model with its MTP layer, packed documents crossing the cp
cut of both slices: the logged lm and MTP losses, every parameter gradient after ``reduce_grads`` (gathered to full
tensors, experts put back in their true order), the global gradient norm the loop clips with, and the checkpoint's
full state equal one process's on the same global batch (two steps: FSDP's forward-method state is reset);
(2) ``torchrun --nproc_per_node 4 -m k3 train --ep 2 --cp 2`` reproduces the single-process loss curve at the same
global batch and saves the same checkpoint.

The cp ranks' losses are parts of one slice's loss while FSDP averages over all ranks (the cp ones included), so a
missing factor C would halve every non-expert gradient: (1) compares the gradients themselves, (2) the logged norm.
"""

import copy

import pytest

from .gloo import needs_backend, spawn
from .runs import ONE, assert_curves_match, assert_same_checkpoint, run, torchrun, train_run as _run
from .test_plan_dp_cp import global_batch
from .test_plan_dp_ep import compare_full_state, compare_gradients, plan_in_process, reference

TOL = 1e-5


def _check_gradients(rank, world):
    from k3.distributed.expert_parallel import ExpertParallelBank

    batch, w = global_batch(), 0.3  # 2 slices (one per ep rank) of 64 tokens, documents crossing both cp cuts
    model, ref, ref_grads = reference(batch, w)
    assert len(model.mtp) == 1
    untouched = copy.deepcopy(model)
    par = plan_in_process(rank, world, dp=1, ep=2, cp=2)
    assert par.mesh.mesh_dim_names == ("dp", "ep", "cp")
    assert par.mesh["ep"].get_local_rank() == rank // 2 and par.mesh["cp"].get_local_rank() == rank % 2
    par.shard(model)
    banks = [m for m in model.modules() if isinstance(m, ExpertParallelBank)]
    assert banks and all(b.w1.to_local().shape[0] == b.num_experts // world for b in banks)  # E/(ep*cp) per rank
    assert len(par._experts) == 3 * len(banks)  # w1, w3, w2 of every bank
    for step in (1, 2):  # twice: nothing left over from the first backward
        grads = compare_gradients(par, model, batch, w, ref, ref_grads, rank, dp=1, ep=2, tag=f" step {step}")
        assert any(k.startswith("mtp.") for k in grads)
    compare_full_state(par, model, untouched)


@pytest.mark.distributed
@needs_backend(4)
def test_ep2_x_cp2_with_mtp_gradients_equal_one_process(tmp_path):
    spawn(_check_gradients, 4, tmp_path)


@pytest.mark.distributed
@needs_backend(4)
def test_ep2_x_cp2_reproduces_the_single_process_loss_curve_and_checkpoint(tmp_path):
    """4 processes: each ep rank its slice of the global batch, split along time over its cp pair (trunk and MTP
    layer); experts over "ep" (MoonEP) and then over the cp pair, the other weights FSDP2-sharded over all 4."""
    single = _run(ONE + ["--batch-size", "4"], tmp_path / "one")
    mesh = _run(torchrun(4) + ["--batch-size", "2", "--ep", "2", "--cp", "2"], tmp_path / "mesh")
    assert all("mtp_loss" in r for r in single + mesh)
    assert_curves_match(single, mesh)  # stated tolerance 1e-5 relative on CPU
    assert_same_checkpoint(tmp_path / "one" / "checkpoint", tmp_path / "mesh" / "checkpoint", 4)


@pytest.mark.distributed
def test_ep_x_cp_refuses_a_mismatched_process_count(tmp_path):
    r = run(ONE + ["--ep", "2", "--cp", "2"], tmp_path / "x", timeout=300)
    assert r.returncode == 1 and "--dp 1 x --ep 2 x --cp 2 needs 4 processes but 1 is running" in r.stderr, \
        r.stderr[-2000:]
    assert "torchrun --nproc_per_node 4" in r.stderr
