"""Gated MLP (dense first layer, shared experts): down(act(gate(x), up(x))) with SiTU-GLU or SwiGLU."""

from __future__ import annotations

import torch
from torch import nn

from ...config import K3Config
from ...ops.situ import glu


class GatedMLP(nn.Module):
    def __init__(self, config: K3Config, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)
        self.act = config.hidden_act
        self.b1, self.b2 = config.activation_situ_beta, config.activation_situ_linear_beta

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(glu(self.gate_proj(x), self.up_proj(x), self.act, self.b1, self.b2))
