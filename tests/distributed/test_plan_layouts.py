"""The 4-rank layouts of k3.distributed.plan.ParallelPlan (dp 2 x ep 2, dp 2 x cp 2, ep 2 x cp 2) against one process.

For each layout: (1) in-process, 4 gloo ranks, the tiny model with its MTP layer on a packed global batch: the logged
lm and MTP losses, every parameter gradient after ``reduce_grads`` (gathered to full tensors, experts put back in
their true order), the global gradient norm the training loop clips with, twice (FSDP's per-iteration state and the
registered CP forward method are reset between steps), and the checkpoint's full state equal one process's;
(2) ``torchrun --nproc_per_node 4 -m k3 train`` with the layout's flags reproduces the single-process loss curve at
the same global batch and saves the same checkpoint.

Adam and Muon are (nearly) invariant to the scale of a gradient, so a loss curve alone would not catch a wrong
gradient scale (a missing factor C under CP would halve every non-expert gradient): (1) compares the gradients
themselves, (2) also the logged gradient norm.
"""

import copy
import os

import pytest
import torch

from .gloo import needs_backend, spawn, test_device
from .runs import ONE, assert_curves_match, assert_same_checkpoint, run, torchrun, train_run as _run
from k3.distributed.expert_parallel import unpermute_experts
from tests.conftest import assert_close

VOCAB, TOL = 128, 1e-5


def slices_batch() -> dict:
    """4 dp x ep slices of 40 tokens; documents cross no slice boundary (as the loader's)."""
    torch.manual_seed(1)
    cuts = {0, 7, 19, 33, 52, 70, 71, 95, 118, 122, 141, 160} | {r * 40 for r in range(4)}
    return {"input_ids": torch.randint(0, VOCAB, (1, 160)), "cu_seqlens": torch.tensor(sorted(cuts))}


def segments_batch() -> dict:
    """2 slices of 64 tokens, each split over 2 cp ranks; documents cross the cp cut of both slices, none crosses a
    slice. The second slice's short documents make the slices' shares of next-token (61 : 57) and MTP targets
    (58 : 50) differ."""
    torch.manual_seed(1)
    cu = torch.tensor([0, 9, 41, 64, 66, 68, 70, 72, 74, 100, 128])
    return {"input_ids": torch.randint(0, VOCAB, (1, 128)), "cu_seqlens": cu}


# (dp, ep, cp), the in-process batch, the per-rank --batch-size of the torchrun run (the one process runs 4)
LAYOUTS = {"dp2xep2": ((2, 2, 1), slices_batch, 1), "dp2xcp2": ((2, 1, 2), segments_batch, 2),
           "ep2xcp2": ((1, 2, 2), segments_batch, 2)}


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


def plan_in_process(rank: int, world: int, dp: int, ep: int, cp: int):
    """The ParallelPlan of a spawned rank (the process group is already up; init_from_env reads the environment)."""
    from k3.distributed.plan import ParallelDims, ParallelPlan

    os.environ["WORLD_SIZE"], os.environ["LOCAL_RANK"] = str(world), str(rank)
    par = ParallelPlan(ParallelDims(dp, ep, cp), device=test_device(rank).type)  # "cuda": cuda:LOCAL_RANK
    assert (par.rank, par.world, par.device, par.batch_slices) == (rank, world, test_device(rank), dp * ep)
    assert par.mesh.mesh_dim_names == ("dp", "ep", "cp")
    coords = (rank // (ep * cp), rank // cp % ep, rank % cp)  # rank = (dp_index * E + ep_index) * C + cp_index
    assert tuple(par.mesh[n].get_local_rank() for n in ("dp", "ep", "cp")) == coords
    return par


def compare_gradients(par, model, batch, w, ref, ref_grads, rank, tag=""):
    """One loss and backward through ``par``: the logged losses, every parameter's gradient after
    ``reduce_grads`` (gathered to full, experts put back in their true order) and the global norm the loop clips
    with equal one process's on the same global batch."""
    model.zero_grad(set_to_none=True)
    loss, lm, mtp, n = par.loss(model, batch, w)[:4]
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
            grads[name] = unpermute_experts(g, par.dims.dp, par.dims.ep) if name in par._experts else g
    assert set(grads) == set(ref_grads) and any(k.startswith("mtp.") for k in grads)
    for name, g in grads.items():
        assert_close(f"rank {rank}{tag} grad {name}", ref_grads[name], g, TOL)
    # the loop clips with torch.nn.utils.clip_grad_norm_(model.parameters()): one mesh, so the global norm
    norm = full(torch.nn.utils.get_total_norm([p.grad for p in model.parameters() if p.grad is not None]))
    ref_norm = torch.nn.utils.get_total_norm(list(ref_grads.values()))
    assert float(norm) == pytest.approx(float(ref_norm), rel=1e-6)


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


def _check_layout(rank, world, layout):
    from k3.distributed.expert_parallel import ExpertParallelBank

    (dp, ep, cp), make_batch, _ = LAYOUTS[layout]
    batch, w = make_batch(), 0.3
    model, ref, ref_grads = reference(batch, w)
    untouched = copy.deepcopy(model)
    par = plan_in_process(rank, world, dp, ep, cp)
    par.shard(model)
    banks = [m for m in model.modules() if isinstance(m, ExpertParallelBank)]
    if ep > 1:  # E/(dp*ep*cp) experts per rank: over the ep row, then over the dp x cp column
        assert banks and all(b.w1.to_local().shape[0] == b.num_experts // world for b in banks)
        assert len(par._experts) == 3 * len(banks)  # w1, w3, w2 of every bank
    else:
        assert not banks and not par._experts
    for step in (1, 2):  # twice: nothing left over from the first backward
        compare_gradients(par, model, batch, w, ref, ref_grads, rank, tag=f" step {step}")
    compare_full_state(par, model, untouched)


def _check_dp2xep2(rank, world):
    _check_layout(rank, world, "dp2xep2")


def _check_dp2xcp2(rank, world):
    _check_layout(rank, world, "dp2xcp2")


def _check_ep2xcp2(rank, world):
    _check_layout(rank, world, "ep2xcp2")


@pytest.mark.slow
@pytest.mark.distributed
@needs_backend(4)
@pytest.mark.parametrize("check", [_check_dp2xep2, _check_dp2xcp2, _check_ep2xcp2], ids=list(LAYOUTS))
def test_gradients_equal_one_process(tmp_path, check):
    spawn(check, 4, tmp_path)


@pytest.mark.slow
@pytest.mark.distributed
@needs_backend(4)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_torchrun_reproduces_the_single_process_loss_curve_and_checkpoint(tmp_path, layout):
    """4 processes of `k3 train` at the same global batch as one: equal up to float summation order (stated
    tolerance 1e-5 relative on CPU, measured <= 2e-7), the MTP loss included, the gradient norm the global one
    (every weight on one mesh), the same saved weights (measured ~3e-6)."""
    (dp, ep, cp), _, per_rank = LAYOUTS[layout]
    single = _run(ONE + ["--batch-size", "4"], tmp_path / "one")
    flags = ["--batch-size", str(per_rank), "--dp", str(dp), "--ep", str(ep), "--cp", str(cp)]
    mesh = _run(torchrun(4) + flags, tmp_path / "mesh")
    assert all("mtp_loss" in r for r in single + mesh)
    assert_curves_match(single, mesh)
    assert_same_checkpoint(tmp_path / "one" / "checkpoint", tmp_path / "mesh" / "checkpoint", 4)


@pytest.mark.slow
@pytest.mark.distributed
def test_a_layout_refuses_a_mismatched_process_count(tmp_path):
    r = run(ONE + ["--dp", "2", "--ep", "2"], tmp_path / "x", timeout=300)
    assert r.returncode == 1 and "--dp 2 x --ep 2 x --cp 1 needs 4 processes but 1 is running" in r.stderr, \
        r.stderr[-2000:]
    assert "torchrun --nproc_per_node 4" in r.stderr
    r = run(torchrun(2) + ["--ep", "2", "--cp", "2"], tmp_path / "y", timeout=300)
    assert r.returncode != 0 and "needs 4 processes but 2 are running" in r.stdout + r.stderr, r.stderr[-2000:]
