"""Weight initialisation: N(0, 0.02) for matrices, output projections scaled by 1/sqrt(2 * layers),
norms at 1, AttnRes pseudo-queries at 0 (uniform mixing at the start), KDA gates at slow forgetting."""

from __future__ import annotations

import math

import torch
from torch import nn

from ..layers.norm import RMSNorm
from ..layers.sequence.kda import KimiDeltaAttention
from ..layers.width.latent_moe import ExpertBank

_OUTPUT_PROJ = ("o_proj", "down_proj", "routed_expert_up_proj")


@torch.no_grad()
def init_weights(model: nn.Module, num_layers: int, std: float = 0.02) -> None:
    out_std = std / math.sqrt(2 * num_layers)
    for name, mod in model.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if isinstance(mod, nn.Linear):
            if leaf.endswith("_res_proj"):
                nn.init.zeros_(mod.weight)
            else:
                nn.init.normal_(mod.weight, std=out_std if leaf in _OUTPUT_PROJ else std)
        elif isinstance(mod, nn.Embedding):
            nn.init.normal_(mod.weight, std=std)
        elif isinstance(mod, RMSNorm):
            nn.init.ones_(mod.weight)
        elif isinstance(mod, ExpertBank):
            nn.init.normal_(mod.w1, std=std)
            nn.init.normal_(mod.w3, std=std)
            nn.init.normal_(mod.w2, std=out_std)
        elif isinstance(mod, KimiDeltaAttention):
            mod.reset_gate_parameters()
            nn.init.ones_(mod.o_norm.weight)
        elif hasattr(mod, "weight") and leaf == "gate" and isinstance(mod.weight, nn.Parameter):
            nn.init.normal_(mod.weight, std=std)  # the router
