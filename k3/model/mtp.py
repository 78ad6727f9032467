"""Multi-token prediction layer (SPEC §1, §7): DeepSeek-V3 style, sharing the embedding and head.

h' = Block(eh_proj([enorm(emb(x_{t+1})); hnorm(h_t)])), logits = head(shared_head.norm(h')) predict x_{t+2}.
The block is a Gated MLA layer with a plain residual (no AttnRes), as in the public K3 MTP implementations.
Checkpoint names: ``model.layers.{num_hidden_layers + i}.{enorm, hnorm, eh_proj, shared_head.norm, ...}``.
"""

from __future__ import annotations

import torch
from torch import nn

from ..config import K3Config
from ..layers.depth.attn_res import DepthStream
from ..layers.norm import RMSNorm
from .block import DecoderLayer


class SharedHead(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.norm = RMSNorm(dim, eps)


class MTPLayer(nn.Module):
    def __init__(self, config: K3Config, index: int):
        super().__init__()
        D, eps = config.hidden_size, config.rms_norm_eps
        plain = config.replace(attn_res="none")
        self.enorm, self.hnorm = RMSNorm(D, eps), RMSNorm(D, eps)
        self.eh_proj = nn.Linear(2 * D, D, bias=False)
        self.block = DecoderLayer(plain, config.num_hidden_layers + index, kind="mla",
                                  moe=config.num_experts > 0 and config.first_k_dense_replace < config.num_hidden_layers)
        self.shared_head = SharedHead(D, eps)

    def forward(self, h: torch.Tensor, next_emb: torch.Tensor, cu_seqlens=None, mixer=None,
                stats=None) -> torch.Tensor:
        """h [B,T,D] the trunk's pre-norm output at t; next_emb [B,T,D] the embedding of token t+1.
        ``mixer``, ``stats``: as for the trunk (e.g. context parallelism; k3.layers.stats)."""
        x = self.eh_proj(torch.cat([self.enorm(next_emb), self.hnorm(h)], dim=-1))
        stream = DepthStream(x, "none", 1, 0.0)
        self.block(stream, cu_seqlens, mixer, stats)
        return self.shared_head.norm(stream.partial)
