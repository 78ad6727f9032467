"""KDA forget gates (SPEC §2.1): raw per-channel logits -> log-decay g <= 0.

Legend: B batch, T time, H heads, K key dim. A_log [H]; dt_bias [H*K]; z raw [B,T,H,K].
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["lower_bound_gate", "softplus_gate", "kda_gate"]


def _prep(z, A_log, dt_bias):
    H, K = z.shape[-2:]
    if A_log.numel() != H:
        raise ValueError(f"A_log must have one entry per head ({H}); got shape {tuple(A_log.shape)}")
    if dt_bias is not None and dt_bias.numel() != H * K:
        raise ValueError(f"dt_bias must have H*K = {H * K} entries; got shape {tuple(dt_bias.shape)}")
    z = z.float()
    if dt_bias is not None:
        z = z + dt_bias.float().view(H, K)
    return z, A_log.float().view(H, 1).exp()


def lower_bound_gate(z: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor | None, lower_bound: float = -5.0):
    """K3's gate: g = lower_bound * sigmoid(exp(A_log) * (z + dt_bias)), so alpha = e^g lies in (e^lb, 1)."""
    if not lower_bound < 0:
        raise ValueError(f"lower_bound must be negative (K3 uses -5); got {lower_bound}")
    z, a = _prep(z, A_log, dt_bias)
    return lower_bound * torch.sigmoid(a * z)


def softplus_gate(z: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor | None):
    """Kimi Linear's gate: g = -exp(A_log) * softplus(z + dt_bias), unbounded below."""
    z, a = _prep(z, A_log, dt_bias)
    return -a * F.softplus(z)


def kda_gate(z, A_log, dt_bias, kind: str = "lower_bound", lower_bound: float = -5.0):
    if kind == "lower_bound":
        return lower_bound_gate(z, A_log, dt_bias, lower_bound)
    if kind == "softplus":
        return softplus_gate(z, A_log, dt_bias)
    raise ValueError(f"unknown KDA gate {kind!r}; expected 'lower_bound' or 'softplus'")
