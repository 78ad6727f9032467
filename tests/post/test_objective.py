"""Exact values of the RL objective's pieces: the budget rule, group advantages, MOPD's token reward, the loss."""

import math

import pytest
import torch

from k3.post.effort import fit_budget, parse_taus, tau_at
from k3.post.objective import budget_reward, group_advantages, kl_k3, mopd_token_rewards, policy_loss


def test_budget_rule_gives_minus_one_over_tau_b0():
    assert budget_reward(1.0, 10, 5.0, 2.0) == 1.0  # T = tau * b0 is within budget
    assert budget_reward(1.0, 11, 5.0, 2.0) == -1.0  # over: -1 even when correct
    assert budget_reward(0.0, 11, 5.0, 2.0) == -1.0
    assert budget_reward(0.0, 7, 5.0, 1.5) == 0.0
    assert budget_reward(1.0, 8, 5.0, 1.5) == -1.0


def test_budget_line_and_tau_curriculum():
    line = fit_budget([10, 20, 30], [15, 25, 35])  # reply = 5 + prompt
    assert (line.a, line.b) == pytest.approx((5.0, 1.0)) and line(40) == pytest.approx(45.0)
    flat = fit_budget([12, 12], [8, 10])
    assert (flat.a, flat.b) == (9.0, 0.0)
    assert [tau_at(s, 10, 0.5, 2.0, 0.4) for s in (0, 2, 4, 9)] == pytest.approx([2.0, 1.25, 0.5, 0.5])
    assert tau_at(3, 10, 1.0, None, 0.5) == 1.0
    assert parse_taus("low=0.25") == {"max": 2.0, "high": 1.0, "low": 0.25}
    with pytest.raises(ValueError, match="effort=value"):
        parse_taus("medium=1")


def test_group_advantages_exact():
    r = torch.tensor([[1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 1.0, 1.0], [-1.0, 1.0, 1.0, 1.0]])
    a = group_advantages(r, eps=0.0 + 1e-12)
    assert a[0].tolist() == pytest.approx([1, -1, -1, 1])  # mean 0.5, population std 0.5
    assert a[1].tolist() == [0, 0, 0, 0]  # equal rewards teach nothing
    std = math.sqrt(0.75)  # of (-1, 1, 1, 1): mean 0.5
    assert a[2].tolist() == pytest.approx([-1.5 / std, 0.5 / std, 0.5 / std, 0.5 / std])
    assert group_advantages(r, scale=False)[2].tolist() == [-1.5, 0.5, 0.5, 0.5]
    with pytest.raises(ValueError, match="prompts, samples"):
        group_advantages(torch.ones(4))


def test_mopd_token_reward_is_the_clipped_stopped_log_ratio():
    teacher = torch.tensor([-1.0, -0.1, -9.0, -0.5], requires_grad=True)
    student = torch.tensor([-2.0, -0.2, -1.0, -8.0], requires_grad=True)
    r = mopd_token_rewards(teacher, student, 5.0)
    assert r.tolist() == pytest.approx([1.0, 0.1, -5.0, 5.0])
    assert not r.requires_grad


def test_policy_loss_values_and_gradient():
    old = torch.tensor([-1.0, -1.0, -1.0, -1.0])
    new = torch.tensor([-0.5, -1.5, -1.0, -0.5], requires_grad=True)  # ratios e^.5, e^-.5, 1, e^.5
    adv = torch.tensor([1.0, 1.0, -2.0, -1.0])
    loss, stats = policy_loss(new, old, adv, 0.2, 0.28, denom=8.0)
    rho = torch.exp(new.detach() - old)
    # token 0: A > 0, rho = 1.65 > 1.28: clipped, no gradient; token 1: A > 0, rho = 0.61 < 0.8: min keeps rho
    # (unclipped side); token 2: rho = 1; token 3: A < 0, rho 1.65: min picks rho A (more negative), unclipped
    want = -(1.28 * 1.0 + rho[1] * 1.0 + 1.0 * -2.0 + rho[3] * -1.0) / 8.0
    assert loss.item() == pytest.approx(want.item())
    assert stats["clipped"] == 1.0
    loss.backward()
    grad = -torch.tensor([0.0, rho[1] * 1.0, 1.0 * -2.0, rho[3] * -1.0]) / 8.0  # d(rho A)/dlogp = rho A
    assert new.grad.tolist() == pytest.approx(grad.tolist())


def test_kl_k3_and_its_place_in_the_loss():
    logp, ref = torch.tensor([-1.0, -2.0]), torch.tensor([-1.5, -1.0])
    q = ref - logp
    assert kl_k3(logp, ref).tolist() == pytest.approx((torch.exp(q) - q - 1).tolist())
    assert kl_k3(logp, logp).tolist() == [0.0, 0.0]
    base, _ = policy_loss(logp, logp, torch.zeros(2), 0.2, 0.2, 1.0)
    with_kl, s = policy_loss(logp, logp, torch.zeros(2), 0.2, 0.2, 1.0, ref, 0.1)
    assert with_kl.item() - base.item() == pytest.approx(0.1 * kl_k3(logp, ref).sum().item())
    assert s["kl"] == pytest.approx(kl_k3(logp, ref).sum().item())
