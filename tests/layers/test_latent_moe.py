import pytest
import torch

from k3 import K3Config
from k3.layers.width.latent_moe import LatentMoE
from k3.ops.norms import rms_norm
from k3.ops.situ import glu
from tests.conftest import assert_close


def per_token_loop(moe: LatentMoE, x):
    """The definition, one token and one expert at a time."""
    w, idx, _ = moe.gate(x)
    ys = []
    for t in range(x.shape[0]):
        z = moe.routed_expert_down_proj(x[t]) if moe.routed_expert_down_proj is not None else x[t]
        u = torch.zeros_like(z, dtype=torch.float32)
        for j in range(idx.shape[1]):
            e = idx[t, j]
            ex = moe.experts
            h = glu(ex.w1[e] @ z, ex.w3[e] @ z, ex.act, ex.b1, ex.b2)
            u = u + w[t, j] * (ex.w2[e] @ h)
        if moe.routed_expert_norm is not None:
            u = rms_norm(u, moe.routed_expert_norm.weight, moe.routed_expert_norm.eps)
        y = moe.routed_expert_up_proj(u) if moe.routed_expert_up_proj is not None else u
        ys.append(y + moe.shared_experts(x[t]))
    return torch.stack(ys)


@pytest.mark.parametrize("variant", [{}, {"latent_moe": False}, {"latent_moe_norm": False}, {"activation": "swiglu"}])
def test_grouped_path_equals_per_token_loop(variant):
    cfg = K3Config.preset("tiny").variant(**variant)
    moe = LatentMoE(cfg)
    x = torch.randn(37, cfg.hidden_size)
    torch.testing.assert_close(moe(x), per_token_loop(moe, x), atol=1e-5, rtol=1e-5)


def test_gradients_reach_every_used_expert_and_never_the_bias():
    cfg = K3Config.preset("tiny")
    moe = LatentMoE(cfg)
    x = torch.randn(64, cfg.hidden_size)
    moe(x).pow(2).sum().backward()
    used = torch.unique(moe.gate(x)[1])
    assert (moe.experts.w1.grad[used].abs().sum((1, 2)) > 0).all()
    assert not moe.gate.e_score_correction_bias.requires_grad
    assert moe.gate.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("variant", [{}, {"latent_moe_norm": False}])
def test_grouped_path_gradients_equal_the_per_token_loop(variant):
    """The routing weight scales the rows before the down projection (what is saved: the act output, not the
    [rows, latent] fp32 expert output); every gradient, the router's through the weights included, equals the
    definition's to float rounding (an fp64 module; the router and the expert sum run in fp32 by design: RMS
    ratio 1e-6)."""
    cfg = K3Config.preset("tiny").variant(**variant)
    torch.manual_seed(0)
    moe = LatentMoE(cfg).double()
    x = torch.randn(37, cfg.hidden_size, dtype=torch.float64)
    grads = []
    for f in (moe, lambda t: per_token_loop(moe, t)):
        moe.zero_grad(set_to_none=True)
        (f(x) * torch.linspace(-1, 1, cfg.hidden_size, dtype=torch.float64)).sum().backward()
        grads.append({n: p.grad.clone() for n, p in moe.named_parameters() if p.grad is not None})
    assert set(grads[0]) == set(grads[1]) and "gate.weight" in grads[0]
    for n, g in grads[1].items():
        assert_close(n, g, grads[0][n], 1e-6)


def test_router_scores_stay_fp32_under_autocast():
    """SPEC §4: the router scores in fp32; bf16 autocast (the CUDA training path) must not lower its matmul."""
    from k3.layers.width.router import Router

    router = Router(K3Config.preset("tiny"))
    x = torch.randn(16, router.weight.shape[1])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = router(x)
    for a, b in zip(got, router(x)):
        assert torch.equal(a, b)
