"""One K3 decoder layer: [AttnRes read] -> norm -> KDA or MLA -> [write] -> [AttnRes read] -> norm -> FFN -> [write].

Weight names are the official ones: ``input_layernorm``, ``self_attn``, ``post_attention_layernorm``,
``mlp`` (dense) or ``block_sparse_moe``, and the two pseudo-queries ``self_attention_res_{proj,norm}`` and
``mlp_res_{proj,norm}`` (flat attributes, so state_dict keys match the checkpoint).
"""

from __future__ import annotations

import torch
from torch import nn

from ..config import K3Config
from ..layers.depth.attn_res import DepthStream, PseudoQuery
from ..layers.norm import RMSNorm
from ..layers.sequence.kda import KimiDeltaAttention
from ..layers.sequence.mla import GatedMLA
from ..layers.stats import Statistics
from ..layers.width.latent_moe import LatentMoE
from ..layers.width.mlp import GatedMLP


class DecoderLayer(nn.Module):
    def __init__(self, config: K3Config, layer_idx: int, kind: str | None = None, moe: bool | None = None):
        super().__init__()
        D, eps = config.hidden_size, config.rms_norm_eps
        self.layer_idx = layer_idx
        self.kind = kind or config.layer_kind(layer_idx)
        self.input_layernorm = RMSNorm(D, eps)
        self.self_attn = KimiDeltaAttention(config, layer_idx) if self.kind == "kda" else GatedMLA(config, layer_idx)
        self.post_attention_layernorm = RMSNorm(D, eps)
        self.is_moe = config.is_moe_layer(layer_idx) if moe is None else moe
        if self.is_moe:
            self.block_sparse_moe = LatentMoE(config, layer_idx)
        else:
            self.mlp = GatedMLP(config, D, config.intermediate_size)
        self.use_attn_res = config.attn_res != "none"
        if self.use_attn_res:
            q_attn, q_mlp = PseudoQuery(D, eps), PseudoQuery(D, eps)
            self.self_attention_res_proj, self.self_attention_res_norm = q_attn.proj, q_attn.norm
            self.mlp_res_proj, self.mlp_res_norm = q_mlp.proj, q_mlp.norm

    def attention_query(self):
        return _Query(self.self_attention_res_proj, self.self_attention_res_norm) if self.use_attn_res else None

    def mlp_query(self):
        return _Query(self.mlp_res_proj, self.mlp_res_norm) if self.use_attn_res else None

    def attend(self, x: torch.Tensor, cu_seqlens: torch.Tensor | None = None,
               stats: Statistics | None = None) -> torch.Tensor:
        """The layer's own token mixer over a whole (packed) sequence."""
        if self.kind == "kda":
            return self.self_attn(x, cu_seqlens)[0]
        return self.self_attn(x, cu_seqlens, stats=stats)

    def ffn(self, x: torch.Tensor, stats: Statistics | None = None) -> torch.Tensor:
        return self.block_sparse_moe(x, stats) if self.is_moe else self.mlp(x)

    def forward(self, stream: DepthStream, cu_seqlens: torch.Tensor | None = None, mixer=None,
                stats: Statistics | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Reads from and writes into ``stream``; returns the two sub-layer outputs it wrote (so that module
        hooks, e.g. FSDP2's pre-backward unshard, see this layer's outputs). ``stats``: where the layer's statistics
        go (``k3.layers.stats``), None to record none.

        ``mixer`` (``k3.model.mixer.Mixer``): where the token mixer's state and kernels, and the FFN's fast paths,
        come from when it is not this forward alone (the inference engine's paged prefill and decode, context
        parallelism's halos and scans). It calls back into the layer's own pieces (``projections``,
        ``activations``, ``output`` of KDA; ``project``, ``absorb``, ``output`` of MLA)."""
        x = stream.read(self.attention_query(), self.input_layernorm)  # the pre-norm inside AttnRes' recomputable region
        if mixer is None:
            a = self.attend(x, cu_seqlens, stats)
        else:
            a = mixer.attend(self, x) if stats is None else mixer.attend(self, x, stats=stats)
        stream.write(a)
        h = stream.read(self.mlp_query(), self.post_attention_layernorm)
        m = self.ffn(h, stats) if mixer is None else mixer.ffn(self, h, stats)
        stream.write(m)
        return a, m


class _Query:
    """A (proj, norm) pair viewed as one pseudo-query, without registering new modules."""

    __slots__ = ("proj", "norm")

    def __init__(self, proj, norm):
        self.proj, self.norm = proj, norm
