"""Pipeline parallelism (k3.distributed.pipeline, pipeline_plan): one step's losses and gradients under --pp equal
one process's, for each schedule, alone and with dp / ep inside the stages; the AttnRes sources cross the stage
boundaries intact (corrupting one changes the loss); the stage split and the boundary shapes.

Spawned gloo ranks (tests/distributed/gloo.py), tiny model, 2 or 4 processes.
"""

import copy
import os

import pytest
import torch

from k3.config import K3Config
from k3.distributed.pipeline import sources_at, split_layers
from k3.distributed.pipeline_plan import PipelineDims, PipelinePlan
from k3.distributed.plan import ParallelDims
from k3.model.transformer import K3ForCausalLM

from .gloo import spawn

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

T, M, W_MTP = 32, 4, 0.3


def _config(layers: int = 6):
    """The tiny preset; with 8 layers (MLA at 4 and 8, as the preset's pattern) for pp 4 x 2 virtual stages."""
    c = K3Config.preset("tiny").replace(vocab_size=256)
    if layers == 8:
        c = c.replace(num_hidden_layers=8, full_attn_layers=(4, 8), kda_layers=(1, 2, 3, 5, 6, 7))
    return c


def _batches(slices: int, seed: int = 1):
    """M packed micro-batches of ``slices`` samples of T tokens, two documents per sample."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(M):
        ids = torch.randint(0, 256, (1, slices * T), generator=g)
        cu = torch.tensor(sorted({0, slices * T, *[s * T for s in range(slices)], *[s * T + 11 for s in range(slices)]}))
        out.append({"input_ids": ids, "cu_seqlens": cu})
    return out


def _reference(model, batches):
    """One process: the mean losses and every gradient, as k3.train.trainer.Trainer.step takes them."""
    lm = mtp = 0.0
    for b in batches:
        out = model(b["input_ids"], cu_seqlens=b["cu_seqlens"], labels=b["input_ids"], mtp_weight=W_MTP,
                    return_logits=False)
        (out["loss"] / len(batches)).backward()
        lm, mtp = lm + out["lm_loss"].item() / len(batches), mtp + out["mtp_loss"].item() / len(batches)
    return lm, mtp, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _full(t):
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def _check_step(rank, world, pp, schedule, dp=1, ep=1, corrupt=False, layers=6):
    os.environ["WORLD_SIZE"] = str(world)  # spawned: init_from_env joins the group the worker opened
    torch.manual_seed(0)
    model = K3ForCausalLM(_config(layers))
    ref = copy.deepcopy(model)
    batches = _batches(dp * ep)
    lm_ref, mtp_ref, grads_ref = _reference(ref, batches)
    plan = PipelinePlan(ParallelDims(dp, ep, 1), PipelineDims(pp, schedule), "cpu", M, T)
    plan.shard(model)
    if corrupt:  # the boundary into the last stage: its block b_0 (the embedding) zeroed on arrival
        last = plan.stages[-1]
        if last.last and last.lo > 0:
            last.register_forward_pre_hook(lambda m, args: (_zero_first_source(args[0]), *args[1:]))
    lm, mtp, *_ = plan.pipeline_step(model, batches, W_MTP)
    plan.reduce_grads(model)
    if corrupt:
        assert abs(lm.item() - lm_ref) > 1e-4, (lm.item(), lm_ref)
        return
    assert abs(lm.item() - lm_ref) < 1e-5 * lm_ref and abs(mtp.item() - mtp_ref) < 1e-5 * mtp_ref, \
        (lm.item(), lm_ref, mtp.item(), mtp_ref)
    experts = set(plan.inner._experts)
    checked = 0
    for name, p in model.named_parameters():
        if name in experts:  # sharded and permuted over the ep row: compared through the loss curve test instead
            continue
        g, want = _full(p.grad), grads_ref.get(name)
        if want is None:  # unused in one process (layer 0's first query mixes one source): no gradient, or zeros
            assert g is None or not g.any(), name
            continue
        torch.testing.assert_close(g, want, rtol=1e-4, atol=1e-6, msg=lambda m: f"{name}: {m}")
        checked += 1
    assert checked > 0
    norm, _ = plan.clip_coefficient(model.parameters(), 1.0)
    want = torch.nn.utils.get_total_norm(list(grads_ref.values()), 2.0)
    if not experts:
        assert abs(norm.item() - want.item()) < 1e-4 * want.item(), (norm.item(), want.item())


def _zero_first_source(x):
    x = x.clone()
    x[0] = 0
    return x


@pytest.mark.parametrize("schedule", ["1f1b", "interleaved", "zero-bubble"])
def test_pp2_step_matches_one_process(schedule, tmp_path):
    spawn(_STEP[(2, schedule)], 2, tmp_path)


@pytest.mark.parametrize("schedule", ["1f1b", "interleaved", "zero-bubble"])
def test_pp4_step_matches_one_process(schedule, tmp_path):
    spawn(_STEP[(4, schedule)], 4, tmp_path)


def test_pp2_dp2_step_matches_one_process(tmp_path):
    spawn(_pp2_dp2, 4, tmp_path)


def test_pp2_ep2_step_matches_one_process(tmp_path):
    spawn(_pp2_ep2, 4, tmp_path)


def test_corrupted_attn_res_source_changes_the_loss(tmp_path):
    spawn(_pp2_corrupt, 2, tmp_path)


def _pp2_1f1b(rank, world):
    _check_step(rank, world, 2, "1f1b")


def _pp2_interleaved(rank, world):
    _check_step(rank, world, 2, "interleaved")


def _pp2_zb(rank, world):
    _check_step(rank, world, 2, "zero-bubble")


def _pp4_1f1b(rank, world):
    _check_step(rank, world, 4, "1f1b")


def _pp4_interleaved(rank, world):  # 8 stages: the 8-layer tiny model
    _check_step(rank, world, 4, "interleaved", layers=8)


def _pp4_zb(rank, world):
    _check_step(rank, world, 4, "zero-bubble", layers=8)


def _pp2_dp2(rank, world):
    _check_step(rank, world, 2, "1f1b", dp=2)


def _pp2_ep2(rank, world):
    _check_step(rank, world, 2, "1f1b", ep=2)


def _pp2_corrupt(rank, world):
    _check_step(rank, world, 2, "1f1b", corrupt=True)


_STEP = {(2, "1f1b"): _pp2_1f1b, (2, "interleaved"): _pp2_interleaved, (2, "zero-bubble"): _pp2_zb,
         (4, "1f1b"): _pp4_1f1b, (4, "interleaved"): _pp4_interleaved, (4, "zero-bubble"): _pp4_zb}


def test_split_layers_balances_and_takes_explicit_counts():
    c = _config()
    for stages in (1, 2, 3, 4, 6):
        b = split_layers(c, stages, 64)
        assert b[0][0] == 0 and b[-1][1] == c.num_hidden_layers and len(b) == stages
        assert all(hi > lo for lo, hi in b) and all(b[i][1] == b[i + 1][0] for i in range(stages - 1))
    assert split_layers(c, 3, 64, [1, 2, 3]) == [(0, 1), (1, 3), (3, 6)]
    with pytest.raises(ValueError, match="--pp-layers"):
        split_layers(c, 2, 64, [1, 2])
    with pytest.raises(ValueError, match="at least one"):
        split_layers(c, 7, 64)


def test_boundary_carries_every_block_and_the_partial_sum():
    c = _config()  # block of 2 decoder layers = 4 sub-layers: b_0 sealed at the first read, then one per block
    assert [sources_at(c, l) for l in range(7)] == [1, 2, 2, 3, 3, 4, 4]


def test_schedule_arguments_are_checked():
    with pytest.raises(ValueError, match="--pp-virtual"):
        PipelineDims(2, "1f1b", 2)
    with pytest.raises(ValueError, match="--pp-schedule"):
        PipelineDims(2, "gpipe")
    assert PipelineDims(2, "zero-bubble").stage_ranks() == [0, 1, 1, 0]
    assert PipelineDims(2, "interleaved").stage_ranks() == [0, 1, 0, 1]
