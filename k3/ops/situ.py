"""SiTU-GLU (SPEC §4): a bounded SwiGLU. SiTU(x) = b1 tanh(x / b1) sigmoid(x); the linear branch is
soft-capped as b2 tanh(u / b2). Each coordinate is bounded by b1 * b2 (= 100 in K3, inside FP8's 448).
Computed in fp32, returned in the input dtype.
"""

from __future__ import annotations

import torch

from .precision import upcast
import torch.nn.functional as F

__all__ = ["situ", "situ_glu", "swiglu", "glu"]


def situ(x: torch.Tensor, beta: float) -> torch.Tensor:
    xf = upcast(x)
    return (beta * torch.tanh(xf / beta) * torch.sigmoid(xf)).to(x.dtype)


def situ_glu(gate: torch.Tensor, up: torch.Tensor, beta1: float = 4.0, beta2: float = 25.0) -> torch.Tensor:
    g, u = upcast(gate), upcast(up)
    return (beta1 * torch.tanh(g / beta1) * torch.sigmoid(g) * (beta2 * torch.tanh(u / beta2))).to(gate.dtype)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return (F.silu(upcast(gate)) * upcast(up)).to(gate.dtype)


def glu(gate: torch.Tensor, up: torch.Tensor, activation: str, beta1: float = 4.0, beta2: float = 25.0):
    """The gated activation named by the config's ``hidden_act``: "situ" or "silu" (SwiGLU)."""
    if activation == "situ":
        return situ_glu(gate, up, beta1, beta2)
    if activation in ("silu", "swiglu"):
        return swiglu(gate, up)
    raise ValueError(f"unknown activation {activation!r}; expected 'situ' or 'silu'")
