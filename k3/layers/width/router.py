"""The MoE router (SPEC §4): sigmoid scores on the full-width input, top-k on score + bias.

The bias ``e_score_correction_bias`` is a buffer, not a parameter: it is set by the balancer (Quantile
Balancing, SPEC §4.1), never by gradients, and it only affects which experts are selected.
"""

from __future__ import annotations

import torch
from torch import nn

from ...config import K3Config
from ...ops.routing import router_scores, select_experts


class Router(nn.Module):
    def __init__(self, config: K3Config):
        super().__init__()
        E, D = config.num_experts, config.hidden_size
        self.weight = nn.Parameter(torch.empty(E, D))
        nn.init.normal_(self.weight, std=D**-0.5)
        self.register_buffer("e_score_correction_bias", torch.zeros(E, dtype=torch.float32))
        self.top_k, self.renormalize = config.num_experts_per_token, config.moe_renormalize
        self.scaling, self.score_func = config.routed_scaling_factor, config.moe_router_activation_func

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [N,D] -> (weights [N,k] fp32, indices [N,k], scores [N,E] fp32). (A decode step's few tokens take one
        fused kernel instead: k3.inference.fast.)"""
        with torch.autocast(x.device.type, enabled=False):  # fp32 scores (SPEC §4); autocast would run bf16
            scores = router_scores(x.float() @ self.weight.float().T, self.score_func)
        w, idx = select_experts(scores, self.e_score_correction_bias, self.top_k, self.renormalize, self.scaling)
        return w, idx, scores
