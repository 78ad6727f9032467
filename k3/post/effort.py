"""The reasoning-effort budget (SPEC §9): b0(x), the tau curriculum, and the per-effort tau.

Each prompt x has an initial token budget b0(x); a trajectory longer than tau * b0(x) gets reward -1
(``k3.post.objective.budget_reward``). b0 is estimated from the reference (SFT) model's own reply lengths: per
domain, a least-squares line b0(x) = a + b * |x| in the prompt's token count, fitted on the reference model's
replies at max effort to calibration prompts of the training split (so a longer problem gets a longer budget).

The curriculum: train the max-effort variant first with a large tau (still a cap), then start the high and low
variants from it and anneal tau linearly from the max value down to theirs over the first ``anneal_frac`` of
their steps (``tau_at``).
"""

from __future__ import annotations

from dataclasses import dataclass

from .tasks.base import EFFORTS

__all__ = ["BudgetLine", "fit_budget", "tau_at", "DEFAULT_TAU"]

DEFAULT_TAU = {"max": 2.0, "high": 1.0, "low": 0.5}  # x b0: max is a loose cap, low half the reference length


@dataclass(frozen=True)
class BudgetLine:
    a: float
    b: float

    def __call__(self, prompt_tokens: int) -> float:
        return max(1.0, self.a + self.b * prompt_tokens)


def fit_budget(prompt_lens: list[int], reply_lens: list[int]) -> BudgetLine:
    """Least squares reply_len ~ a + b * prompt_len (b = 0 when every prompt has the same length)."""
    if not prompt_lens or len(prompt_lens) != len(reply_lens):
        raise ValueError("fit_budget needs one reply length per prompt length, at least one")
    n = len(prompt_lens)
    mx, my = sum(prompt_lens) / n, sum(reply_lens) / n
    var = sum((x - mx) ** 2 for x in prompt_lens)
    b = 0.0 if var == 0 else sum((x - mx) * (y - my) for x, y in zip(prompt_lens, reply_lens)) / var
    return BudgetLine(my - b * mx, b)


def tau_at(step: int, steps: int, tau: float, tau_from: float | None, anneal_frac: float) -> float:
    """tau at optimiser step ``step`` (0-based) of ``steps``: ``tau_from`` -> ``tau`` linearly over the first
    ``anneal_frac`` of the steps, then ``tau``; ``tau`` throughout when ``tau_from`` is None."""
    if tau_from is None or anneal_frac <= 0:
        return tau
    t = min(1.0, step / max(1.0, anneal_frac * steps))
    return tau_from + (tau - tau_from) * t


def parse_taus(spec: str | None) -> dict[str, float]:
    """"max=2,high=1,low=0.5" -> {effort: tau}, the defaults for efforts not named."""
    out = dict(DEFAULT_TAU)
    for part in (spec or "").split(","):
        if not part.strip():
            continue
        name, _, value = part.partition("=")
        name = name.strip()
        if name not in EFFORTS or not value:
            raise ValueError(f"--tau takes effort=value pairs with effort in {list(EFFORTS)}, e.g. "
                             f"'max=2,high=1,low=0.5'; got {part!r}")
        try:
            out[name] = float(value)
        except ValueError:
            raise ValueError(f"--tau {name}={value!r}: not a number") from None
        if not out[name] > 0:
            raise ValueError(f"--tau {name} must be > 0; got {value}")
    return out
