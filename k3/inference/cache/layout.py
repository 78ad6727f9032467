"""Byte layout of the hybrid cache (SPEC §7): what one token costs in the MLA layers, what one request's KDA
state costs, and the one page size both are stored in.

Legend: L_mla / L_kda layer counts, R kv_lora_rank, Dr rope dim, H KDA heads, K head dim, W conv width.
  MLA, per token:     L_mla * (R + Dr) values            (K3: 24 * 576 = 13,824 -> 27 KB in bf16)
  KDA, per request:   L_kda * (H*K*K fp32 state + 3 * H*K*(W-1) conv tail)   (K3: ~435 MB), constant in length
  page:               page_tokens tokens of MLA latents; a KDA state takes ceil(state / page) pages
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ...config import K3Config


@dataclass(frozen=True)
class CacheLayout:
    n_mla: int
    latent: int  # R + Dr
    n_kda: int
    kda_heads: int
    kda_dim: int
    conv_width: int
    page_tokens: int
    dtype: torch.dtype = torch.float32  # MLA latents and conv tails; recurrent states are always fp32

    @classmethod
    def from_config(cls, c: K3Config, page_tokens: int, dtype: torch.dtype = torch.float32) -> "CacheLayout":
        return cls(len(c.full_attn_layers), c.kv_lora_rank + c.qk_rope_head_dim, len(c.kda_layers), c.kda_num_heads,
                   c.kda_head_dim, c.short_conv_kernel_size, page_tokens, dtype)

    @property
    def itemsize(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    @property
    def mla_bytes_per_token(self) -> int:
        return self.n_mla * self.latent * self.itemsize

    @property
    def state_numel(self) -> int:
        """fp32 values of one KDA layer's recurrent state."""
        return self.kda_heads * self.kda_dim * self.kda_dim

    @property
    def conv_numel(self) -> int:
        """Values of one KDA layer's three conv tails."""
        return 3 * self.kda_heads * self.kda_dim * (self.conv_width - 1)

    @property
    def kda_state_bytes(self) -> int:
        return self.n_kda * (4 * self.state_numel + self.itemsize * self.conv_numel)

    @property
    def page_bytes(self) -> int:
        return self.page_tokens * self.mla_bytes_per_token or max(self.kda_state_bytes, 1)

    @property
    def kda_pages(self) -> int:
        return math.ceil(self.kda_state_bytes / self.page_bytes) if self.n_kda else 0

    def mla_pages(self, tokens: int) -> int:
        return math.ceil(tokens / self.page_tokens) if self.n_mla else 0
