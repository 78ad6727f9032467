"""Learning-rate schedule (SPEC §5): 1% linear warmup, then cosine decay to ``min_ratio`` of the peak.

``lr_lambda`` is the multiplier of the peak lr at optimiser step ``step`` (0-based, the value LambdaLR asks
for before that step). Warmup ramps (step + 1) / W so that the first step already moves the weights and step
W - 1 reaches the peak; the cosine runs from the peak at step W to ``min_ratio`` at step ``total_steps``.

Changing ``total_steps`` on resume (``k3 train --steps`` larger or smaller than before) keeps the lr continuous:
``resumed_at = (r, m)`` says the run was resumed at step r with multiplier m, and from r on the lr follows a
half cosine from m down to ``min_ratio`` at the new ``total_steps``. A finished run (already at the minimum)
therefore goes on at the minimum lr; a run stopped half-way decays over the steps it has left. The steps
already taken keep the lr they had.
"""

from __future__ import annotations

import functools
import math

import torch


def warmup_steps(total_steps: int, warmup_frac: float = 0.01) -> int:
    return max(1, round(warmup_frac * total_steps))


def _cosine(progress: float, top: float, bottom: float) -> float:
    return bottom + (top - bottom) * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


def lr_lambda(step: int, total_steps: int, warmup_frac: float = 0.01, min_ratio: float = 0.1,
              resumed_at: tuple[int, float] | None = None) -> float:
    if total_steps < 1 or step < 0:
        raise ValueError(f"lr_lambda: need total_steps >= 1 and step >= 0, got step={step}, total_steps={total_steps}")
    if not 0.0 <= min_ratio <= 1.0 or not 0.0 <= warmup_frac < 1.0:
        raise ValueError(f"lr_lambda: need 0 <= min_ratio <= 1 and 0 <= warmup_frac < 1, "
                         f"got min_ratio={min_ratio}, warmup_frac={warmup_frac}")
    if resumed_at is not None and step >= resumed_at[0]:
        r, m = resumed_at
        return _cosine((step - r) / max(1, total_steps - r), m, min_ratio)
    W = warmup_steps(total_steps, warmup_frac)
    if step < W:
        return (step + 1) / W
    return _cosine((step - W) / max(1, total_steps - W), 1.0, min_ratio)


def resume_point(trainer_state: dict, saved_total: int, total_steps: int, warmup_frac: float = 0.01,
                 min_ratio: float = 0.1) -> tuple[int, float] | None:
    """``resumed_at`` for a run resumed from ``trainer_state`` (its ``schedule`` entry, or none from older
    checkpoints) with ``total_steps``: the checkpoint's own while the total is unchanged, else (the step, the
    multiplier the lr had there), so the lr goes on from where it was."""
    saved = trainer_state.get("schedule") or {"total_steps": saved_total, "resumed_at": None}
    prev = tuple(saved["resumed_at"]) if saved["resumed_at"] is not None else None
    if saved["total_steps"] == total_steps:
        return prev
    step = trainer_state["step"]
    return step, lr_lambda(step, saved["total_steps"], warmup_frac, min_ratio, prev)


def build_scheduler(optimizer: torch.optim.Optimizer, total_steps: int, warmup_frac: float = 0.01,
                    min_ratio: float = 0.1, resumed_at: tuple[int, float] | None = None
                    ) -> torch.optim.lr_scheduler.LambdaLR:
    """LambdaLR scaling every param group (Muon's and AdamW's alike) by ``lr_lambda``."""
    lr_lambda(0, total_steps, warmup_frac, min_ratio)  # validate now, not at the first step
    fn = functools.partial(lr_lambda, total_steps=total_steps, warmup_frac=warmup_frac, min_ratio=min_ratio,
                           resumed_at=resumed_at)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, fn)
