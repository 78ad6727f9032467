"""Normalisations used across K3: RMSNorm, the per-head gated RMSNorm of KDA's output, L2 norm.

All reduce in fp32 and return the input dtype.
"""

from __future__ import annotations

import torch

from .precision import upcast

__all__ = ["rms_norm", "gated_rms_norm", "l2_norm"]


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float = 1e-5) -> torch.Tensor:
    xf = upcast(x)
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = y * upcast(weight)
    return y.to(x.dtype)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    """sigmoid(gate) * RMSNorm(x) * weight, normalising over the last dim (one head's channels)."""
    return (rms_norm(upcast(x), weight, eps) * torch.sigmoid(upcast(gate))).to(x.dtype)


def l2_norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    xf = upcast(x)
    return (xf * torch.rsqrt(xf.pow(2).sum(-1, keepdim=True) + eps)).to(x.dtype)
