"""Expert parallelism with MoonEP dispatch (SPEC §8) against the single-process LatentMoE: outputs, gradients of
the inputs, the replicated parameters (after the DP all-reduce) and every owner's expert shard; static receive size.

Multi-process tests spawn 2 or 4 ranks (gloo on CPU, or NCCL on cuda:rank with K3_TEST_BACKEND=nccl). Every
rank builds the same LatentMoE and the same global tokens from one seed, runs the single-process reference on all
ranks' tokens concatenated, then the expert-parallel module on its own slice. Legend: R ranks, S tokens per rank,
D hidden, E experts, k experts per token, m = E/R.
"""

import dataclasses

import pytest
import torch
import torch.distributed as dist

from k3 import K3Config
from k3.distributed.expert_parallel import (ExpertParallelBank, _replica_exchange, dispatch_layout,
                                            parallelize_moe)
from k3.layers.width.latent_moe import LatentMoE

from .gloo import spawn, worlds
from tests.conftest import assert_close

S = 6  # tokens per rank when the split is even
# (name, bias on the router's e_score_correction_bias, tokens per rank or None for S each)
SCENARIOS = {
    2: [("hot_pair", {0: 1.0, 1: 1.0}, None),  # every token -> experts 0 and 1, both on rank 0
        ("hot_last", {7: 1.0, 6: 0.3, 0: 0.3}, None),  # expert 7 split over both ranks, source 0's slots too
        ("random", {}, None),
        ("uneven_tokens", {2: 1.0, 3: 0.5}, [9, 3])],
    4: [("hot_pair", {0: 1.0, 1: 1.0}, None),  # both on rank 0: ranks 1..3 take split pieces as replicas
        ("hot_spread", {0: 1.0, 5: 0.4, 6: 0.4}, None),
        ("random", {}, None),
        ("uneven_tokens", {7: 1.0}, [2, 9, 7, 6])],
}


# ---------------------------------------------------------------- single process: the layout


@pytest.mark.parametrize("R,E", [(2, 8), (4, 8), (4, 16), (8, 64)], ids=lambda x: str(x))
@pytest.mark.parametrize("seed", range(5))
def test_dispatch_layout_tiles_every_expert_and_balances(R, E, seed):
    g = torch.Generator().manual_seed(seed)
    hot = torch.rand(E, generator=g) ** 6  # skewed loads: a few experts take most slots
    counts = torch.stack([torch.multinomial(hot, 12, replacement=True, generator=g).bincount(minlength=E)
                          for _ in range(R)])  # [R,E], 12 slots per rank
    plan, pieces = dispatch_layout(counts)
    assert pieces.shape == (R, R, 2 * E // R)
    assert (pieces.sum(0) == plan.counts).all()  # each entry gets exactly its planned rows
    assert (pieces.sum((0, 2)) == 12).all()  # every rank receives exactly S*k rows
    for s in range(R):  # each source sends each of its slots exactly once
        sent = torch.zeros(E, dtype=torch.int64).scatter_add_(0, plan.experts.clamp(min=0).reshape(-1),
                                                               pieces[s].reshape(-1))
        assert (sent == counts[s]).all()
    m = E // R
    for r in range(R):
        ex = _replica_exchange(plan, r, m)
        n = int((plan.experts[r] >= 0).sum())
        assert ex.pick.shape == (n,) and len(ex.send_local) == sum(ex.send_splits)
        assert sum(ex.recv_splits) <= m  # Theorem 1: at most E/R replicas per rank
        assert ex.recv_splits[r] == 0 and ex.send_splits[r] == 0


def test_dispatch_layout_rejects_float_counts_and_uneven_totals():
    with pytest.raises(ValueError, match="integer"):
        dispatch_layout(torch.ones(2, 8))
    with pytest.raises(ValueError, match="not divisible by num_ranks"):
        dispatch_layout(torch.tensor([[1, 0, 0, 0], [0, 0, 0, 0]]))


def test_parallelize_moe_needs_a_process_group():
    if dist.is_initialized():
        pytest.skip("a process group is initialized in this process")
    with pytest.raises(RuntimeError, match="init_process_group"):
        parallelize_moe(LatentMoE(K3Config.preset("tiny")))


# ---------------------------------------------------------------- multi-process (gloo, or NCCL: see gloo.py)


def _build_moe(cfg, bias):
    torch.manual_seed(0)
    moe = LatentMoE(cfg)
    for e, b in bias.items():
        moe.gate.e_score_correction_bias[e] = b
    return moe


def _replicated_grads(moe):
    return {n: p.grad for n, p in moe.named_parameters() if not n.startswith("experts.")}


def _split_sources(layout, E):
    """(source rank, expert) pairs whose slots go to two or more destination ranks."""
    R, _, M = layout.pieces.shape
    experts = layout.plan.experts.clamp(min=0)[None].expand(R, R, M)
    sent_RRE = torch.zeros(R, R, E, dtype=torch.int64, device=layout.pieces.device).scatter_add_(2, experts,
                                                                                                 layout.pieces)
    return int(((sent_RRE > 0).sum(1) > 1).sum())


def _check_scenario(rank, world, name, bias, lens):
    cfg = K3Config.preset("tiny")
    E, k, D = cfg.num_experts, cfg.num_experts_per_token, cfg.hidden_size
    m = E // world
    lens = lens or [S] * world
    start, end = sum(lens[:rank]), sum(lens[:rank + 1])
    torch.manual_seed(1)
    x, dy = torch.randn(1, sum(lens), D), torch.randn(1, sum(lens), D)

    ref = _build_moe(cfg, bias)
    x_ref = x.clone().requires_grad_()
    y_ref = ref(x_ref)
    (y_ref * dy).sum().backward()

    moe = _build_moe(cfg, bias)
    parallelize_moe(moe, None)
    assert isinstance(moe.experts, ExpertParallelBank) and moe.experts.w1.shape[0] == m
    xl = x[:, start:end].clone().requires_grad_()
    y = moe(xl)
    (y * dy[:, start:end]).sum().backward()
    for g in _replicated_grads(moe).values():  # as DP would
        dist.all_reduce(g)

    tag = f"R{world} {name} rank {rank}"
    step = moe.experts.last_step
    assert step.received_rows == sum(lens) * k // world, f"{tag}: received {step.received_rows} rows"
    if name.startswith("hot"):
        replicas = torch.tensor([step.replicas])
        dist.all_reduce(replicas)
        assert replicas.item() > 0, f"{tag}: the skewed loads should force replicas"
    assert_close(f"{tag} y", y_ref[:, start:end], y, 1e-5)
    assert_close(f"{tag} dx", x_ref.grad[:, start:end], xl.grad, 1e-5)
    ref_grads = _replicated_grads(ref)
    for n, g in _replicated_grads(moe).items():
        assert_close(f"{tag} d{n}", ref_grads[n], g, 1e-5)
    for w in ("w1", "w2", "w3"):
        g_ref = getattr(ref.experts, w).grad[rank * m:(rank + 1) * m]
        assert_close(f"{tag} d experts.{w}", g_ref, getattr(moe.experts, w).grad, 1e-5)
    return _split_sources(step.layout, E)


def _check_errors(rank, world):
    cfg = dataclasses.replace(K3Config.preset("tiny"), num_experts=6)
    if 6 % world:
        with pytest.raises(ValueError, match="multiple of the group size"):
            parallelize_moe(LatentMoE(cfg))
    moe = LatentMoE(K3Config.preset("tiny"))
    parallelize_moe(moe)
    with pytest.raises(ValueError, match="already expert-parallel"):
        parallelize_moe(moe)


def _check_all(rank, world):
    splits = [_check_scenario(rank, world, name, bias, lens) for name, bias, lens in SCENARIOS[world]]
    assert sum(splits) > 0, "no scenario sent one source's slots of an expert to two ranks"
    _check_errors(rank, world)


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("world", worlds(2, 4))
def test_expert_parallel_moe_matches_single_process(world, tmp_path):
    """One spawn per world size: skewed loads forcing split experts and replicas, random routing and uneven token
    counts; outputs, input grads, replicated-parameter grads (all-reduced) and each owner's expert grads."""
    spawn(_check_all, world, tmp_path)
