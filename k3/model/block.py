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
        if config.is_moe_layer(layer_idx) if moe is None else moe:
            self.block_sparse_moe = LatentMoE(config)
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

    def ffn(self, x: torch.Tensor) -> torch.Tensor:
        return self.block_sparse_moe(x) if hasattr(self, "block_sparse_moe") else self.mlp(x)

    def forward(self, stream: DepthStream, cu_seqlens: torch.Tensor | None = None,
                mixer=None) -> tuple[torch.Tensor, torch.Tensor]:
        """Reads from and writes into ``stream``; returns the two sub-layer outputs it wrote (so that module
        hooks, e.g. FSDP2's pre-backward unshard, see this layer's outputs).

        ``mixer``: where the token mixer's state and kernels come from when it is not this forward alone: an
        object with ``attend(layer, x) -> y`` (the inference engine's paged prefill and decode, context
        parallelism's halos and scans). It calls back into the layer's own pieces (``projections``,
        ``activations``, ``output`` of KDA; ``queries``, ``latent``, ``absorb``, ``output`` of MLA)."""
        x = stream.read(self.attention_query(), self.input_layernorm)  # the pre-norm inside AttnRes' recomputable region
        if mixer is not None:
            a = mixer.attend(self, x)
        elif self.kind == "kda":
            a, _ = self.self_attn(x, cu_seqlens)
        else:
            a = self.self_attn(x, cu_seqlens)
        stream.write(a)
        m = self.ffn(stream.read(self.mlp_query(), self.post_attention_layernorm))
        stream.write(m)
        return a, m


class _Query:
    """A (proj, norm) pair viewed as one pseudo-query, without registering new modules."""

    __slots__ = ("proj", "norm")

    def __init__(self, proj, norm):
        self.proj, self.norm = proj, norm
