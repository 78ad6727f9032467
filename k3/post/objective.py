"""The RL objective's pieces (SPEC §9), each a plain function of tensors with its formula beside it.

Legend: N tokens of the step's trajectories (packed), G samples per prompt, P prompts.

- ``budget_reward``: the effort rule. A trajectory of T(y) tokens whose prompt has budget b0(x) gets -1 when
  T(y) > tau * b0(x), else the verifier's reward.
- ``group_advantages``: GRPO's group normalisation, A_i = (r_i - mean_g r) / (std_g r + eps) over the G samples of
  each prompt (population std); a group whose rewards are all equal has A = 0 (it teaches nothing).
- ``mopd_token_rewards``: MOPD's dense reward r_t = clip(log pi_T(y_t) - log pi_S(y_t), -R_max, R_max), computed
  without gradient (the stop-gradient), used directly as each token's advantage.
- ``policy_loss``: the token-level clipped surrogate (PPO's ratio clipping, DAPO's token-level mean and
  decoupled clip range): with rho_t = exp(log pi(y_t) - log mu(y_t)), mu the policy that SAMPLED the token
  (recorded at sampling time, so tokens of older policies carried over by partial rollout are corrected),

      L = -(1/N) sum_t min(rho_t A_t, clip(rho_t, 1 - eps_low, 1 + eps_high) A_t)  [+ beta KL_t]

  with KL_t the k3 estimator exp(q_t) - q_t - 1, q_t = log pi_ref(y_t) - log pi(y_t) (unbiased, >= 0).
"""

from __future__ import annotations

import torch

__all__ = ["budget_reward", "group_advantages", "mopd_token_rewards", "policy_loss", "kl_k3"]


def budget_reward(reward: float, length: int, budget: float, tau: float) -> float:
    """The verifier's ``reward`` unless the trajectory's ``length`` exceeds ``tau * budget``: then -1."""
    return -1.0 if length > tau * budget else float(reward)


def group_advantages(rewards_PG: torch.Tensor, eps: float = 1e-6, scale: bool = True) -> torch.Tensor:
    """[P,G] rewards -> [P,G] advantages: minus the group mean, over the group's std (``scale``) + eps."""
    if rewards_PG.dim() != 2:
        raise ValueError(f"rewards must be [prompts, samples per prompt]; got shape {tuple(rewards_PG.shape)}")
    centred = rewards_PG - rewards_PG.mean(dim=1, keepdim=True)
    if not scale:
        return centred
    return centred / (rewards_PG.std(dim=1, unbiased=False, keepdim=True) + eps)


@torch.no_grad()
def mopd_token_rewards(teacher_logp_N: torch.Tensor, student_logp_N: torch.Tensor, r_max: float) -> torch.Tensor:
    """clip(log pi_T(y_t) - log pi_S(y_t), -r_max, r_max) per token, no gradient."""
    return (teacher_logp_N - student_logp_N).clamp(-r_max, r_max)


def kl_k3(logp_N: torch.Tensor, ref_logp_N: torch.Tensor) -> torch.Tensor:
    """Per-token KL(pi || pi_ref) estimate exp(q) - q - 1, q = log pi_ref - log pi (Schulman's k3)."""
    q = ref_logp_N - logp_N
    return torch.exp(q) - q - 1


def policy_loss(logp_N: torch.Tensor, sampled_logp_N: torch.Tensor, adv_N: torch.Tensor, eps_low: float,
                eps_high: float, denom: float, ref_logp_N: torch.Tensor | None = None, beta: float = 0.0
                ) -> tuple[torch.Tensor, dict]:
    """The clipped token-level surrogate SUMMED over these tokens and divided by ``denom`` (the number of tokens of
    the whole step, so that micro-batches add up to the step's token mean). -> (loss, {"clipped": tokens whose
    ratio was clipped in the direction that stops the gradient, "kl": summed KL estimate (0 without a reference)})."""
    ratio = torch.exp(logp_N - sampled_logp_N)
    clipped_ratio = ratio.clamp(1 - eps_low, 1 + eps_high)
    surrogate = torch.minimum(ratio * adv_N, clipped_ratio * adv_N)
    loss = -surrogate.sum()
    stats = {"clipped": float(((ratio * adv_N) > (clipped_ratio * adv_N)).sum()), "kl": 0.0}
    if ref_logp_N is not None and beta:
        kl = kl_k3(logp_N, ref_logp_N)
        loss = loss + beta * kl.sum()
        stats["kl"] = float(kl.detach().sum())
    return loss / denom, stats
