"""Gated MLP (dense first layer, shared experts): down(act(gate(x), up(x))) with SiTU-GLU or SwiGLU."""

from __future__ import annotations

import torch
from torch import nn

from ...config import K3Config
from ...ops.situ import glu
from ..fuse import fuse_linears


class GatedMLP(nn.Module):
    def __init__(self, config: K3Config, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)
        self.act = config.hidden_act
        self.b1, self.b2 = config.activation_situ_beta, config.activation_situ_linear_beta
        self.in_proj: torch.Tensor | None = None  # gate and up in one tensor (fuse_projections)

    def fuse_projections(self) -> None:
        """Inference: gate_proj and up_proj become one matmul (``k3.layers.fuse``)."""
        self.in_proj, self._in_sizes = fuse_linears([self.gate_proj, self.up_proj])

    def activation(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return glu(gate, up, self.act, self.b1, self.b2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.activation(self.gate_proj(x), self.up_proj(x)))
