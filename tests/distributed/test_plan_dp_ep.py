"""`--dp D --ep E` (k3.distributed.plan.ParallelPlan on a ("dp", "ep", "cp") mesh with cp = 1) against one process.

Two checks: (1) in-process, 4 gloo ranks (dp 2 x ep 2): every parameter gradient after ``reduce_grads``, gathered
to full tensors (experts put back in their true order), and the global gradient norm the training loop clips with,
equal the single-process ones on the same global batch; (2) ``torchrun --nproc_per_node 4 -m k3 train --dp 2 --ep 2``
reproduces the single-process loss curve at the same global batch and saves the same checkpoint.

Adam and Muon are (nearly) invariant to the scale of a gradient, so a loss curve alone would not catch a wrong
gradient scale: (1) compares the gradients themselves, (2) also the logged gradient norm.
"""

import copy
import os

import pytest
import torch

from .gloo import needs_backend, spawn, test_device
from .runs import ONE, assert_curves_match, assert_same_checkpoint, run, torchrun, train_run as _run
from k3.distributed.expert_parallel import unpermute_experts
from tests.conftest import assert_close

VOCAB, SLICE, TOL = 128, 40, 1e-5


def global_batch(world: int) -> dict:
    """A packed row of ``world`` slices of SLICE tokens; documents cross no slice boundary (as the loader's)."""
    torch.manual_seed(1)
    cuts = {0, 7, 19, 33, 52, 70, 71, 95, 118, 122, 141, world * SLICE} | {r * SLICE for r in range(world)}
    cu = torch.tensor(sorted(c for c in cuts if c <= world * SLICE))
    return {"input_ids": torch.randint(0, VOCAB, (1, world * SLICE)), "cu_seqlens": cu}


def reference(batch: dict, mtp_weight: float):
    """The tiny model (with its MTP layer) and its single-process loss and gradients on the whole batch."""
    from k3.config import K3Config
    from k3.model.transformer import K3ForCausalLM

    torch.manual_seed(0)
    model = K3ForCausalLM(K3Config.preset("tiny").replace(vocab_size=VOCAB)).train()
    clean = copy.deepcopy(model)
    out = model(batch["input_ids"], cu_seqlens=batch["cu_seqlens"], labels=batch["input_ids"], mtp_weight=mtp_weight)
    out["loss"].backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return clean, out, grads


def full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _check_gradients(rank, world):
    from k3.distributed.expert_parallel import ExpertParallelBank

    batch, w = global_batch(world), 0.3
    model, ref, ref_grads = reference(batch, w)
    untouched = copy.deepcopy(model)
    par = plan_in_process(rank, world, dp=2, ep=2)
    assert par.mesh.mesh_dim_names == ("dp", "ep", "cp") and par.batch_slices == 4
    assert par.mesh["dp"].get_local_rank() == rank // 2 and par.mesh["ep"].get_local_rank() == rank % 2
    par.shard(model)
    banks = [m for m in model.modules() if isinstance(m, ExpertParallelBank)]
    assert banks and all(b.w1.to_local().shape[0] == b.num_experts // world for b in banks)  # E/(dp*ep) per rank
    assert len(par._experts) == 3 * len(banks)  # w1, w3, w2 of every bank
    compare_gradients(par, model, batch, w, ref, ref_grads, rank, dp=2, ep=2)
    compare_full_state(par, model, untouched)


def plan_in_process(rank: int, world: int, dp: int = 1, ep: int = 1, cp: int = 1):
    """The ParallelPlan of a spawned rank (the process group is already up; init_from_env reads the environment)."""
    from k3.distributed.plan import ParallelDims, ParallelPlan

    os.environ["WORLD_SIZE"], os.environ["LOCAL_RANK"] = str(world), str(rank)
    par = ParallelPlan(ParallelDims(dp, ep, cp), device=test_device(rank).type)  # "cuda": cuda:LOCAL_RANK
    assert (par.rank, par.world, par.device) == (rank, world, test_device(rank))
    return par


def compare_gradients(par, model, batch, w, ref, ref_grads, rank, dp, ep, tag=""):
    """One loss and backward through ``par``: the logged losses, every parameter's gradient after
    ``reduce_grads`` (gathered to full, experts put back in their true order) and the global norm the loop clips
    with equal one process's on the same global batch."""
    model.zero_grad(set_to_none=True)
    loss, lm, mtp, n = par.loss(model, batch, w)
    loss.backward()
    par.reduce_grads(model)
    assert n == batch["input_ids"].numel()
    # the logged losses: the mean over the ranks of their parts is the single-process value
    assert float(lm) == pytest.approx(ref["lm_loss"].item(), rel=1e-6)
    assert float(mtp) == pytest.approx(ref["mtp_loss"].item(), rel=1e-6)
    grads = {}
    for name, p in model.named_parameters():
        if p.grad is not None:
            g = full(p.grad)  # collective: the same order on every rank
            grads[name] = unpermute_experts(g, dp, ep) if name in par._experts else g
    assert set(grads) == set(ref_grads)
    for name, g in grads.items():
        assert_close(f"rank {rank}{tag} grad {name}", ref_grads[name], g, TOL)
    # the loop clips with torch.nn.utils.clip_grad_norm_(model.parameters()): one mesh, so the global norm
    norm = full(torch.nn.utils.get_total_norm([p.grad for p in model.parameters() if p.grad is not None]))
    ref_norm = torch.nn.utils.get_total_norm(list(ref_grads.values()))
    assert float(norm) == pytest.approx(float(ref_norm), rel=1e-6)
    return grads


def compare_full_state(par, model, untouched) -> None:
    """The checkpoint's full state (on rank 0, the writer; empty elsewhere): the single-process names, shapes and
    (untrained) values."""
    state, ref_state = par.full_state(model), untouched.state_dict()
    if par.rank != 0:
        assert state == {}
        return
    assert set(state) == set(ref_state)
    for k, v in ref_state.items():
        assert state[k].shape == v.shape and torch.equal(state[k], v), k


@pytest.mark.distributed
@needs_backend(4)
def test_dp2_x_ep2_gradients_equal_one_process(tmp_path):
    spawn(_check_gradients, 4, tmp_path)


@pytest.mark.distributed
@needs_backend(4)
def test_dp2_x_ep2_reproduces_the_single_process_loss_curve_and_checkpoint(tmp_path):
    """4 processes: every rank its slice of the global batch, experts over "ep" (MoonEP) and then "dp", the
    other weights FSDP2-sharded over all 4 ranks."""
    single = _run(ONE + ["--batch-size", "4"], tmp_path / "one")
    mesh = _run(torchrun(4) + ["--batch-size", "1", "--dp", "2", "--ep", "2"], tmp_path / "mesh")
    # same samples, the global token mean in both: equal up to float summation order (stated tolerance 1e-5,
    # measured <= 2e-7); the gradient norm is the global one (every weight on one mesh)
    assert_curves_match(single, mesh)
    assert_same_checkpoint(tmp_path / "one" / "checkpoint", tmp_path / "mesh" / "checkpoint", 4)  # measured ~3e-6


@pytest.mark.distributed
def test_dp_x_ep_refuses_a_mismatched_process_count(tmp_path):
    r = run(ONE + ["--dp", "2", "--ep", "2"], tmp_path / "x", timeout=300)
    assert r.returncode == 1 and "--dp 2 x --ep 2 x --cp 1 needs 4 processes but 1 is running" in r.stderr, \
        r.stderr[-2000:]
    assert "torchrun --nproc_per_node 4" in r.stderr
    r = run(torchrun(2) + ["--dp", "2", "--ep", "2"], tmp_path / "y", timeout=300)
    assert r.returncode != 0 and "needs 4 processes but 2 are running" in r.stdout + r.stderr, r.stderr[-2000:]

