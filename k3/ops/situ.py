"""SiTU-GLU (SPEC §4): a bounded SwiGLU. SiTU(x) = b1 tanh(x / b1) sigmoid(x); the linear branch is
soft-capped as b2 tanh(u / b2). Each coordinate is bounded by b1 * b2 (= 100 in K3, inside FP8's 448).
Computed in fp32, returned in the input dtype.
"""

from __future__ import annotations

import torch

from .precision import upcast
import torch.nn.functional as F

__all__ = ["situ", "situ_glu", "swiglu", "glu", "glu_backward"]


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


def glu_backward(gate: torch.Tensor, up: torch.Tensor, dh: torch.Tensor, activation: str, beta1: float = 4.0,
                 beta2: float = 25.0) -> tuple[torch.Tensor, torch.Tensor]:
    """(d gate, d up) of ``glu(gate, up, activation, beta1, beta2)`` for its gradient dh, in fp32, returned in
    gate's and up's dtypes (what autograd gives through glu's upcasts):
        SiTU-GLU  h = s(g) l(u),  s = b1 tanh(g/b1) sigmoid(g),  l = b2 tanh(u/b2)
                  dg = dh l (sech^2(g/b1) sigmoid(g) + s (1 - sigmoid(g))),  du = dh s sech^2(u/b2)
        SwiGLU    h = g sigmoid(g) u
                  dg = dh u sigmoid(g) (1 + g (1 - sigmoid(g))),  du = dh g sigmoid(g)"""
    g, u, d = upcast(gate), upcast(up), upcast(dh)
    sg = torch.sigmoid(g)
    if activation == "situ":
        t1, t2 = torch.tanh(g / beta1), torch.tanh(u / beta2)
        s, lin = beta1 * t1 * sg, beta2 * t2
        dg = d * lin * ((1 - t1 * t1) * sg + s * (1 - sg))
        du = d * s * (1 - t2 * t2)
    elif activation in ("silu", "swiglu"):
        dg = d * u * sg * (1 + g * (1 - sg))
        du = d * g * sg
    else:
        raise ValueError(f"unknown activation {activation!r}; expected 'situ' or 'silu'")
    return dg.to(gate.dtype), du.to(up.dtype)
