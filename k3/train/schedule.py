"""Learning-rate schedule (SPEC §5): 1% linear warmup, then cosine decay to ``min_ratio`` of the peak.

``lr_lambda`` is the multiplier of the peak lr at optimiser step ``step`` (0-based, the value LambdaLR asks
for before that step). Warmup ramps (step + 1) / W so that the first step already moves the weights and step
W - 1 reaches the peak; the cosine runs from the peak at step W to ``min_ratio`` at step ``total_steps``.
"""

from __future__ import annotations

import functools
import math

import torch


def warmup_steps(total_steps: int, warmup_frac: float = 0.01) -> int:
    return max(1, round(warmup_frac * total_steps))


def lr_lambda(step: int, total_steps: int, warmup_frac: float = 0.01, min_ratio: float = 0.1) -> float:
    if total_steps < 1 or step < 0:
        raise ValueError(f"lr_lambda: need total_steps >= 1 and step >= 0, got step={step}, total_steps={total_steps}")
    if not 0.0 <= min_ratio <= 1.0 or not 0.0 <= warmup_frac < 1.0:
        raise ValueError(f"lr_lambda: need 0 <= min_ratio <= 1 and 0 <= warmup_frac < 1, "
                         f"got min_ratio={min_ratio}, warmup_frac={warmup_frac}")
    W = warmup_steps(total_steps, warmup_frac)
    if step < W:
        return (step + 1) / W
    progress = min(1.0, (step - W) / max(1, total_steps - W))
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_scheduler(optimizer: torch.optim.Optimizer, total_steps: int, warmup_frac: float = 0.01,
                    min_ratio: float = 0.1) -> torch.optim.lr_scheduler.LambdaLR:
    """LambdaLR scaling every param group (Muon's and AdamW's alike) by ``lr_lambda``."""
    lr_lambda(0, total_steps, warmup_frac, min_ratio)  # validate now, not at the first step
    fn = functools.partial(lr_lambda, total_steps=total_steps, warmup_frac=warmup_frac, min_ratio=min_ratio)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, fn)
