"""SPEC §5: Muon (per head, per expert), the combined optimiser, the schedule and QK-clip."""

import copy
import math

import pytest
import torch

from k3 import K3Config, K3ForCausalLM
from k3.layers.sequence.kda import KimiDeltaAttention
from k3.layers.sequence.mla import GatedMLA
from k3.ops.max_logit import causal_max_logit_reference as max_causal_logit
from k3.layers.width.latent_moe import LatentMoE
from k3.train.optim import CombinedOptimizer, Muon, build_optimizer, describe_param_groups, newton_schulz
from k3.train.optim.muon import block_shape, parse_split, to_blocks
from k3.layers.stats import Statistics, merge_max_logits
from k3.train.qk_clip import qk_clip_
from k3.train.schedule import build_scheduler, lr_lambda

TINY = K3Config.preset("tiny")
A, B, C = 3.4445, -4.7750, 2.0315


def ns_scalar(x, steps=5):
    """What NS does to each singular value of the Frobenius-normalised matrix."""
    for _ in range(steps):
        x = A * x + B * x**3 + C * x**5
    return x


def with_spectrum(n, s):
    U, _ = torch.linalg.qr(torch.randn(n, n))
    V, _ = torch.linalg.qr(torch.randn(n, n))
    return U @ torch.diag(s) @ V.T


# ---- Newton-Schulz ------------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(4, 32, 96), (4, 96, 32), (3, 64, 64), (2, 8, 16, 24)],
                         ids=["wide", "tall", "square", "2-batch-dims"])
def test_newton_schulz_lands_in_band_batched(shape):
    G = torch.randn(shape)
    if shape[-1] == shape[-2]:  # square Gaussians have near-zero singular values; make them well posed
        G = G + 4 * torch.eye(shape[-1])
    O = newton_schulz(G)
    s = torch.linalg.svdvals(O)
    assert O.shape == G.shape and O.dtype == G.dtype
    assert s.min() > 0.5 and s.max() < 1.5, (s.min(), s.max())
    torch.testing.assert_close(O[1], newton_schulz(G[1]))  # each matrix on its own


def test_newton_schulz_ill_conditioned_matches_scalar_iteration():
    s = torch.logspace(0, -2, 64)  # condition number 100
    G = with_spectrum(64, s)
    U, S, Vh = torch.linalg.svd(G.double())
    O = newton_schulz(G)
    expect = U @ torch.diag(ns_scalar(S / S.norm())) @ Vh  # NS acts on each singular value separately
    torch.testing.assert_close(O.double(), expect, atol=2e-4, rtol=0)
    sv = torch.linalg.svdvals(O)
    assert sv.min() > 0.5 and sv.max() < 1.5
    # the documented limit: directions below ~1e-3 of the Frobenius norm are not raised into the band
    assert ns_scalar(torch.tensor(1.1e-3)) > 0.5 > ns_scalar(torch.tensor(1e-3))


def test_newton_schulz_rejects_vectors_and_zero_is_safe():
    with pytest.raises(ValueError, match="matrix"):
        newton_schulz(torch.randn(8))
    assert torch.equal(newton_schulz(torch.zeros(3, 4, 5)), torch.zeros(3, 4, 5))


# ---- per-head and per-expert Muon -----------------------------------------------------------------------


def step_delta(module, grads, **kw):
    """Copy ``module``, give it ``grads`` (name -> tensor), take one optimiser step; return name -> delta."""
    m = copy.deepcopy(module)
    opt = build_optimizer(m, lr=1e-2, weight_decay=0.0, **kw)
    before = {n: p.detach().clone() for n, p in m.named_parameters()}
    for n, p in m.named_parameters():
        p.grad = grads[n].clone()
    opt.step()
    return {n: p.detach() - before[n] for n, p in m.named_parameters()}


@pytest.mark.parametrize("proj,kind", [("q_proj", "rows"), ("o_proj", "cols")])
def test_per_head_blocks_are_orthogonalised_independently(proj, kind):
    layer = KimiDeltaAttention(TINY)
    H, K = layer.num_heads, layer.head_dim
    name = f"{proj}.weight"
    assert describe_param_groups(layer)[name].split == f"{kind}:{H}"
    grads = {n: torch.randn_like(p) for n, p in layer.named_parameters()}
    other = {n: g.clone() for n, g in grads.items()}
    head = (slice(2 * K, 3 * K), slice(None)) if kind == "rows" else (slice(None), slice(2 * K, 3 * K))
    other[name][head] = torch.randn_like(other[name][head])  # only head 2's gradient changes

    d1, d2 = step_delta(layer, grads), step_delta(layer, other)
    keep = torch.ones(H * K, dtype=torch.bool)
    keep[2 * K:3 * K] = False
    pick = (lambda d: d[keep]) if kind == "rows" else (lambda d: d[:, keep])
    torch.testing.assert_close(pick(d1[name]), pick(d2[name]), atol=0, rtol=0)
    assert not torch.allclose(d1[name][head], d2[name][head])
    # each head's step is exactly that head's own NS, scaled by 0.2 sqrt(max(A, B)) of the head block
    g2 = other[name][head]
    torch.testing.assert_close(d2[name][head], -1e-2 * 0.2 * math.sqrt(max(g2.shape)) * newton_schulz(g2))
    # the same step without the per-head split couples the heads: the test above has teeth
    w1, w2 = step_delta(layer, grads, per_head=False), step_delta(layer, other, per_head=False)
    assert not torch.allclose(pick(w1[name]), pick(w2[name]))


def test_experts_are_updated_per_expert_by_muon_never_adamw():
    moe = LatentMoE(TINY)
    experts = [f"experts.{w}" for w in ("w1", "w2", "w3")]
    plan = describe_param_groups(moe)
    assert all((plan[n].optimizer, plan[n].split) == ("muon", "experts") for n in experts)
    opt = build_optimizer(moe)
    bank = {id(p) for p in moe.experts.parameters()}
    assert not any(id(p) in bank or p.dim() == 3 for g in opt.optimizers["adamw"].param_groups for p in g["params"])
    grads = {n: torch.randn_like(p) for n, p in moe.named_parameters()}
    other = {n: g.clone() for n, g in grads.items()}
    for n in experts:
        other[n][3] = torch.randn_like(other[n][3])  # only expert 3's gradient changes
    d1, d2 = step_delta(moe, grads), step_delta(moe, other)
    rest = [e for e in range(TINY.num_experts) if e != 3]
    for n in experts:
        torch.testing.assert_close(d1[n][rest], d2[n][rest], atol=0, rtol=0)
        assert not torch.allclose(d1[n][3], d2[n][3])
        g = other[n][3]
        torch.testing.assert_close(d2[n][3], -1e-2 * 0.2 * math.sqrt(max(g.shape)) * newton_schulz(g))
    assert describe_param_groups(moe.experts)["w1"].split == "experts"  # a bare bank: Muon only
    assert list(build_optimizer(moe.experts).optimizers) == ["muon"]


def test_3d_tensors_never_fall_back_silently():
    w = torch.nn.Parameter(torch.randn(4, 8, 8))
    with pytest.raises(ValueError, match="routed experts"):
        Muon([w], split="whole")
    with pytest.raises(ValueError, match="divisible"):
        Muon([torch.nn.Parameter(torch.randn(10, 8))], split="rows:4")
    odd = torch.nn.Module()
    odd.w = torch.nn.Parameter(torch.randn(4, 8, 8))
    with pytest.raises(ValueError, match="neither a routed-expert bank"):
        describe_param_groups(odd)


def test_describe_param_groups_tiny_model():
    model = K3ForCausalLM(TINY)
    plan = describe_param_groups(model)
    names = [n for n, _ in model.named_parameters()]
    assert sorted(plan) == sorted(names)
    H = TINY.num_attention_heads
    kda, mla, moe = "model.layers.0.self_attn.", "model.layers.3.self_attn.", "model.layers.1.block_sparse_moe."
    assert isinstance(model.model.layers[0].self_attn, KimiDeltaAttention)
    assert isinstance(model.model.layers[3].self_attn, GatedMLA)
    expect = {
        "model.embed_tokens.weight": ("adamw", None), "lm_head.weight": ("adamw", None),
        "model.norm.weight": ("adamw", None), "model.output_attn_res_proj.weight": ("adamw", None),
        kda + "A_log": ("adamw", None), kda + "dt_bias": ("adamw", None), kda + "q_conv1d.weight": ("adamw", None),
        kda + "o_norm.weight": ("adamw", None),
        kda + "q_proj.weight": ("muon", f"rows:{TINY.kda_num_heads}"), kda + "g_proj.weight": ("muon", "rows:4"),
        kda + "f_b_proj.weight": ("muon", "rows:4"), kda + "o_proj.weight": ("muon", "cols:4"),
        kda + "f_a_proj.weight": ("muon", "whole"), kda + "b_proj.weight": ("muon", "whole"),
        mla + "q_b_proj.weight": ("muon", f"rows:{H}"), mla + "kv_b_proj.weight": ("muon", f"rows:{H}"),
        mla + "o_proj.weight": ("muon", f"cols:{H}"), mla + "g_proj.weight": ("muon", f"rows:{H}"),
        mla + "q_a_proj.weight": ("muon", "whole"), mla + "kv_a_proj_with_mqa.weight": ("muon", "whole"),
        mla + "kv_a_layernorm.weight": ("adamw", None),
        moe + "experts.w1": ("muon", "experts"), moe + "experts.w2": ("muon", "experts"),
        moe + "gate.weight": ("muon", "whole"), moe + "shared_experts.down_proj.weight": ("muon", "whole"),
        "mtp.0.block.self_attn.kv_b_proj.weight": ("muon", f"rows:{H}"), "mtp.0.eh_proj.weight": ("muon", "whole"),
    }
    for n, (o, s) in expect.items():
        assert (plan[n].optimizer, plan[n].split) == (o, s), n
    assert not plan["model.norm.weight"].weight_decay and plan["lm_head.weight"].weight_decay
    for n, p in model.named_parameters():
        assert (plan[n].optimizer == "muon") == (p.dim() >= 2 and 1 not in p.shape and "conv" not in n
                                                 and "embed" not in n and "lm_head" not in n), n
    # the built optimiser holds each parameter exactly once, in the group its plan says
    opt = build_optimizer(model)
    seen = [(id(p), g["name"]) for g in opt.param_groups for p in g["params"]]
    assert len(seen) == len({i for i, _ in seen}) == len(names)
    where = dict(seen)
    for n, p in model.named_parameters():
        pl = plan[n]
        want = f"muon/{pl.split}" if pl.optimizer == "muon" else "adamw/" + ("decay" if pl.weight_decay else "no_decay")
        assert where[id(p)] == want, n
    assert all(s.split == "whole" for s in describe_param_groups(model, per_head=False).values()
               if s.optimizer == "muon" and s.split != "experts")


# ---- update size and weight decay ------------------------------------------------------------------------


@pytest.mark.parametrize("shape,split", [((64, 64), "whole"), ((32, 128), "whole"), ((64, 16), "rows:4"),
                                         ((16, 64), "cols:4")])
def test_update_rms_matches_adamw(shape, split):
    p = torch.nn.Parameter(torch.randn(shape) + 3 * torch.eye(*shape))
    p0, lr = p.detach().clone(), 1e-2
    p.grad = torch.randn(shape) + 3 * torch.eye(*shape)  # well-conditioned blocks: RMS(O) ~ 1/sqrt(max(A, B))
    Muon([p], lr=lr, weight_decay=0.0, split=split).step()
    rms = (p.detach() - p0).pow(2).mean().sqrt().item()
    assert 0.15 * lr < rms < 0.22 * lr, rms / lr


def test_weight_decay_is_decoupled():
    p0, lr, wd = torch.randn(32, 48), 1e-2, 0.1
    grads = [torch.randn(32, 48) for _ in range(3)]
    runs = {}
    for decay in (0.0, wd):
        p = torch.nn.Parameter(p0.clone())
        opt = Muon([p], lr=lr, weight_decay=decay)
        traj = [p0]
        for g in grads:
            p.grad = g.clone()
            opt.step()
            traj.append(p.detach().clone())
        runs[decay] = traj
    # the gradient step U_t is the same with and without decay; decay only shrinks the weights
    for t in range(1, 4):
        U = runs[0.0][t - 1] - runs[0.0][t]
        torch.testing.assert_close(runs[wd][t], runs[wd][t - 1] * (1 - lr * wd) - U, atol=1e-6, rtol=0)
    q = torch.nn.Parameter(p0.clone())
    q.grad = torch.zeros_like(q)
    Muon([q], lr=lr, weight_decay=wd).step()
    torch.testing.assert_close(q.detach(), p0 * (1 - lr * wd))


# ---- combined optimiser, state dict, schedule -------------------------------------------------------------


def train(model, opt, sched, steps, seed):
    """Optimiser steps on gradients that depend on the weights (so a wrong restore shows) plus seeded noise;
    no forward pass, which keeps the test fast while covering every parameter kind of the model."""
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        opt.zero_grad()
        for p in model.parameters():
            p.grad = torch.sin(3 * p.detach()) + 0.1 * torch.randn(p.shape, generator=gen)
        opt.step()
        sched.step()


@pytest.mark.slow
def test_state_dict_round_trip_continues_identically():
    model = K3ForCausalLM(TINY)
    opt = build_optimizer(model, lr=3e-3)
    sched = build_scheduler(opt, total_steps=20, warmup_frac=0.1)
    assert isinstance(opt, CombinedOptimizer) and isinstance(opt, torch.optim.Optimizer)
    train(model, opt, sched, 2, seed=1)
    saved = copy.deepcopy((model.state_dict(), opt.state_dict(), sched.state_dict()))
    assert "momentum_buffer" in next(iter(saved[1]["muon"]["state"].values()))
    assert "exp_avg" in next(iter(saved[1]["adamw"]["state"].values()))
    train(model, opt, sched, 2, seed=2)

    fresh = K3ForCausalLM(TINY)
    fresh.load_state_dict(saved[0])
    opt2 = build_optimizer(fresh, lr=3e-3)
    sched2 = build_scheduler(opt2, total_steps=20, warmup_frac=0.1)
    opt2.load_state_dict(saved[1])
    sched2.load_state_dict(saved[2])
    lrs = [g["lr"] for g in opt2.param_groups]
    assert lrs == pytest.approx([3e-3 * lr_lambda(2, 20, 0.1)] * len(lrs))
    train(fresh, opt2, sched2, 2, seed=2)
    for (n, a), b in zip(model.state_dict().items(), fresh.state_dict().values()):
        torch.testing.assert_close(a, b, atol=0, rtol=0, msg=n)
    fresh.load_state_dict(saved[0])  # and the restore matters: without the optimiser state the run differs
    opt3 = build_optimizer(fresh, lr=3e-3)
    sched3 = build_scheduler(opt3, total_steps=20, warmup_frac=0.1)
    sched3.load_state_dict(saved[2])
    train(fresh, opt3, sched3, 2, seed=2)
    q_proj = lambda m: m.model.layers[0].self_attn.q_proj.weight  # noqa: E731
    assert not torch.allclose(q_proj(fresh), q_proj(model))
    with pytest.raises(ValueError, match="parts"):
        opt2.load_state_dict({"muon": saved[1]["muon"]})


def test_schedule_warmup_and_cosine():
    total = 1000  # warmup = 10 steps
    assert lr_lambda(0, total) == pytest.approx(0.1)
    assert lr_lambda(4, total) == pytest.approx(0.5)
    assert lr_lambda(9, total) == lr_lambda(10, total) == pytest.approx(1.0)
    assert lr_lambda(10 + 495, total) == pytest.approx(0.55)  # cosine midpoint: halfway to min_ratio
    assert lr_lambda(total, total) == pytest.approx(0.1) == lr_lambda(5 * total, total)
    assert lr_lambda(total, total, min_ratio=0.0) == pytest.approx(0.0, abs=1e-12)
    vals = [lr_lambda(s, total) for s in range(10, total + 1)]
    assert all(a >= b for a, b in zip(vals, vals[1:]))
    assert lr_lambda(0, 10) == 1.0  # warmup is at least 1 step: max(1, round(0.1)) = 1
    with pytest.raises(ValueError, match="min_ratio"):
        lr_lambda(0, 10, min_ratio=2.0)
    # the scheduler scales every group of the combined optimiser, Muon's and AdamW's
    model = KimiDeltaAttention(TINY)
    opt = build_optimizer(model, lr=1.0)
    sched = build_scheduler(opt, total_steps=200)
    for step in range(5):
        for o in opt.optimizers.values():
            assert all(g["lr"] == pytest.approx(lr_lambda(step, 200)) for g in o.param_groups)
        opt.step()
        sched.step()


# ---- QK-clip --------------------------------------------------------------------------------------------


def brute_max_logit(layer, x):
    """Per-head max over causal pairs of q.k * scale, straight from the weights."""
    B, T, _ = x.shape
    pos = torch.arange(T)[None].expand(B, T)
    inp = layer.project(x, pos)  # q_pe and k_pe rotated when the layer uses RoPE
    q_nope, q_pe, c_kv, k_pe = inp.q_nope, inp.q_pe, inp.c_kv, inp.k_pe
    k_nope = layer.kv_b_proj(c_kv).view(B, T, layer.num_heads, -1)[..., : layer.nope]
    s = (torch.einsum("bthn,bshn->bhts", q_nope, k_nope) + torch.einsum("bthp,bsp->bhts", q_pe, k_pe)) * layer.scale
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    return s.masked_fill(~causal, float("-inf")).amax(dim=(0, 2, 3)).detach()


@pytest.mark.parametrize("cfg", [TINY, TINY.replace(q_lora_rank=None, mla_use_nope=False)], ids=["k3", "k2-like"])
def test_qk_clip_returns_the_head_to_tau_and_leaves_others(cfg):
    layer = GatedMLA(cfg).train()
    H, Dn, Dr = layer.num_heads, layer.nope, layer.pe
    q_lin = layer.q_b_proj if cfg.q_lora_rank else layer.q_proj
    with torch.no_grad():  # blow up head 1's logits
        q_lin.weight.view(H, Dn + Dr, -1)[1] *= 12.0
        layer.kv_b_proj.weight.view(H, Dn + layer.dv, -1)[1, :Dn] *= 12.0
    x = torch.randn(2, 12, cfg.hidden_size)

    def max_logit():  # a forward that records its max logits -> {layer index: [H]}
        stats = Statistics(("max_logit",))
        layer(x, stats=stats)
        return stats.max_logit

    recorded = max_logit()
    before = recorded[0].clone()
    torch.testing.assert_close(before, brute_max_logit(layer, x), rtol=1e-5, atol=1e-5)
    tau = 2.0 * before[[0, 2, 3]].max().item()
    assert before[1] > 2 * tau
    k_pe_w = layer.kv_a_proj_with_mqa.weight.detach().clone()

    seen = []
    hook = layer.o_proj.register_forward_pre_hook(lambda m, a: seen.append(a[0].detach().view(2, 12, H, -1)))
    recorded = merge_max_logits(recorded, max_logit())  # a second micro-batch: the running max of identical ones
    assert qk_clip_(layer, recorded, tau) == 1
    after = max_logit()[0]
    hook.remove()
    assert after[1].item() == pytest.approx(tau, rel=1e-3)
    torch.testing.assert_close(after[[0, 2, 3]], before[[0, 2, 3]], atol=0, rtol=0)
    torch.testing.assert_close(seen[1][:, :, [0, 2, 3]], seen[0][:, :, [0, 2, 3]], atol=0, rtol=0)
    assert not torch.allclose(seen[1][:, :, 1], seen[0][:, :, 1])
    assert torch.equal(layer.kv_a_proj_with_mqa.weight, k_pe_w)  # shared k_pe untouched
    assert qk_clip_(layer, None, tau) == 0 and qk_clip_(layer, {}, tau) == 0  # nothing recorded: nothing clipped


@pytest.mark.slow
def test_max_logit_tracking_is_chunked_masked_and_opt_in():
    q, k = torch.randn(2, 3, 23, 8), torch.randn(2, 3, 23, 8)
    valid = torch.ones(2, 23, dtype=torch.bool)
    valid[1, 9:] = False  # row 1 is a 9-token document padded to 23
    for v in (None, valid):
        torch.testing.assert_close(max_causal_logit(q, k, 0.5, valid=v, chunk=5), max_causal_logit(q, k, 0.5, valid=v))
    vis = torch.ones(23, 23, dtype=torch.bool).tril()[None] & valid[:, :, None] & valid[:, None, :]  # [2,23,23]
    s = (q @ k.mT * 0.5).masked_fill(~vis[:, None], float("-inf")).amax(dim=(0, 2, 3))
    torch.testing.assert_close(max_causal_logit(q, k, 0.5, valid=valid, chunk=4), s)
    q[1, :, 9:] = 1e3  # padding never counts
    torch.testing.assert_close(max_causal_logit(q, k, 0.5, valid=valid), s)
    model = K3ForCausalLM(TINY).train()
    ids = torch.randint(0, TINY.vocab_size, (1, 16))
    assert model(ids, labels=ids).max_logit is None  # off by default
    out = model(ids, labels=ids, record=("max_logit",))
    mlas = [m for m in model.modules() if isinstance(m, GatedMLA)]
    assert sorted(out.max_logit) == sorted(m.layer_idx for m in mlas) and len(mlas) == 3  # two MLA layers, MTP's
    assert all(m.shape == (TINY.num_attention_heads,) for m in out.max_logit.values())
    assert qk_clip_(model, out.max_logit, tau=1e9) == 0


def test_bucketed_newton_schulz_equals_one_call_per_parameter():
    layer = KimiDeltaAttention(TINY)
    grads = {n: torch.randn_like(p) for n, p in layer.named_parameters()}
    runs = []
    for bucket_numel in (1, 2**26):  # 1: every parameter alone; default: same-shape blocks batched together
        m = copy.deepcopy(layer)
        plan = describe_param_groups(m)
        ps = dict(m.named_parameters())
        opt = Muon([{"params": [ps[n]], "split": plan[n].split} for n in ps if plan[n].optimizer == "muon"],
                   lr=1e-2, bucket_numel=bucket_numel)
        for n, p in ps.items():
            p.grad = grads[n].clone()
        opt.step()
        runs.append(m.state_dict())
    for n in runs[0]:
        torch.testing.assert_close(runs[0][n], runs[1][n], atol=1e-6, rtol=1e-5, msg=n)


def test_schedule_resumed_with_another_total_is_continuous():
    """A run resumed at step r with a new total follows a half cosine from its lr at r down to the minimum."""
    from k3.train.schedule import resume_point

    old, new, r = 100, 300, 60
    point = resume_point({"step": r}, old, new)
    assert point == (r, pytest.approx(lr_lambda(r, old)))
    vals = [lr_lambda(s, new, resumed_at=point) for s in range(r, new + 1)]
    assert vals[0] == pytest.approx(lr_lambda(r, old)) and vals[-1] == pytest.approx(0.1)
    assert all(a > b for a, b in zip(vals, vals[1:]))
    finished = resume_point({"step": old}, old, new)  # a finished run goes on at the minimum
    assert [lr_lambda(s, new, resumed_at=finished) for s in range(old, new)] == pytest.approx([0.1] * (new - old))
    same = {"step": r, "schedule": {"total_steps": new, "resumed_at": point}}
    assert resume_point(same, old, new) == point  # unchanged total: the checkpoint's own schedule
    assert resume_point({"step": r}, old, old) is None


def test_batched_newton_schulz_equals_one_call_per_matrix():
    """The batched iteration (one bmm chain over [N, A, B]) is the per-matrix iteration run N times: each matrix
    is normalised by its own norm, so batching changes nothing but the launch count (bitwise on CPU, fp32)."""
    G = torch.randn(6, 24, 40)
    G[2] *= 1e3  # very different scales in one batch
    batched = newton_schulz(G)
    for i in range(G.shape[0]):
        torch.testing.assert_close(batched[i], newton_schulz(G[i]), atol=0, rtol=0)


def test_muon_runs_one_newton_schulz_per_shape_group(monkeypatch):
    """A whole model's step: one batched Newton-Schulz call per distinct (min, max) block shape, whatever the number
    of parameters, heads and experts, and the same update as one call per parameter."""
    import k3.train.optim.muon as muon

    model = K3ForCausalLM(TINY)
    calls = []
    real = muon.newton_schulz
    monkeypatch.setattr(muon, "newton_schulz", lambda G, *a, **k: calls.append(tuple(G.shape)) or real(G, *a, **k))
    opt = build_optimizer(model, lr=1e-2)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    shapes = set()
    for group in opt.optimizers["muon"].param_groups:
        for p in group["params"]:
            kind, H = parse_split(group["split"], p.shape)
            A, B = block_shape(p.shape, kind, H)
            shapes.add((min(A, B), max(A, B)))
    opt.step()
    assert sorted(c[1:] for c in calls) == sorted(shapes)  # one call per shape, every block of it inside
    blocks = sum(to_blocks(p, *parse_split(g["split"], p.shape)).shape[0]
                 for g in opt.optimizers["muon"].param_groups for p in g["params"])
    assert sum(c[0] for c in calls) == blocks > len(calls)


def test_muon_keeps_its_buckets_while_the_parameters_stay_and_rebuilds_them_when_they_change():
    """The bucket plan is built once (the host's per-step work), rebuilt when a parameter loses its gradient or the
    groups are replaced (load_state_dict); a gradient in another memory layout than its parameter's (transposed)
    gives the same step as a contiguous one."""
    torch.manual_seed(3)
    a, b = torch.nn.Parameter(torch.randn(24, 40)), torch.nn.Parameter(torch.randn(24, 40))
    ga, gb = torch.randn(24, 40), torch.randn(24, 40)
    opt = Muon([{"params": [a, b], "split": "rows:4"}], lr=1e-2)
    ref = Muon([{"params": [a.detach().clone().requires_grad_(), b.detach().clone().requires_grad_()],
                 "split": "rows:4"}], lr=1e-2)
    ra, rb = ref.param_groups[0]["params"]
    for step in range(3):
        a.grad, b.grad = ga.clone(), (gb.mT.contiguous().mT if step == 1 else gb.clone())  # step 1: b's grad strided
        ra.grad, rb.grad = ga.clone(), gb.clone()
        if step == 2:
            b.grad = rb.grad = None  # b's gradient goes: the plan must drop it
        plan = opt._plan
        opt.step()
        ref._plan = (None, [])  # the reference rebuilds every step
        ref.step()
        assert (opt._plan is plan) == (step == 1)  # built at step 0, kept at step 1, rebuilt at step 2
        torch.testing.assert_close(a.detach(), ra.detach(), atol=0, rtol=0)
        torch.testing.assert_close(b.detach(), rb.detach(), atol=0, rtol=0)
    kept = opt._plan
    opt.load_state_dict(opt.state_dict())  # new group dicts
    a.grad = ga.clone()
    opt.step()
    assert opt._plan is not kept


@pytest.mark.slow
@pytest.mark.parametrize("fused_adamw", [False, True])
def test_clipping_folded_into_the_step_equals_clip_grad_norm_then_step(fused_adamw):
    """``clip_coefficient`` + ``step(scale=coef)`` (the factor read in Muon's momentum pass and by fused AdamW as
    its grad_scale; the foreach AdamW multiplies the gradients) == torch's clip_grad_norm_ then step(), over two
    steps with the norm above the limit and one below; the same norm is returned."""
    from k3.train.optim import CombinedOptimizer, clip_coefficient

    torch.manual_seed(0)
    model = K3ForCausalLM(TINY)
    grads = [{n: torch.randn_like(p) * s for n, p in model.named_parameters()} for s in (3.0, 1e-3, 2.0)]

    def run(folded):
        m = copy.deepcopy(model)
        opt = build_optimizer(m, lr=1e-2)
        if fused_adamw:  # on CPU too: the grad_scale path of torch's fused kernel
            a = opt.optimizers["adamw"]
            opt = CombinedOptimizer(muon=opt.optimizers["muon"], adamw=torch.optim.AdamW(
                a.param_groups, lr=1e-2, betas=(0.9, 0.95), eps=1e-8, fused=True))
        norms = []
        for g in grads:
            for n, p in m.named_parameters():
                p.grad = g[n].clone()
            if folded:
                norm, coef = clip_coefficient(m.parameters(), 1.0)
                opt.step(scale=coef)
            else:
                norm = torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
                opt.step()
            norms.append(norm)
            opt.zero_grad()
        return m, norms

    (ref, ref_norms), (out, out_norms) = run(False), run(True)
    torch.testing.assert_close(torch.stack(out_norms), torch.stack(ref_norms), rtol=1e-6, atol=0)
    assert ref_norms[0] > 1 > ref_norms[1]  # clipped and not
    for (n, p), q in zip(out.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, atol=1e-6, rtol=1e-5, msg=n)


def test_clip_coefficient_needs_gradients():
    from k3.train.optim import clip_coefficient

    with pytest.raises(ValueError, match="no parameter has a gradient"):
        clip_coefficient(K3ForCausalLM(TINY).parameters(), 1.0)
