"""Routed experts kept packed for serving (SPEC §6-§7): MXFP4 weights in memory (uint8 nibble pairs plus one E8M0
scale per 32 weights: 4.25 bits per weight) and MXFP8 matmul inputs, dequantised one expert at a time (the CPU
reference) or one tile at a time in registers (the Triton kernel on CUDA) inside the grouped matmul, never the
whole bank at once.

``PackedExpertBank`` is a drop-in for ``ExpertBank`` at inference (same ``forward(z, weights, idx)``, so the engine
does not change) and computes what the QAT forward (``config.qat = "mxfp4"``) computes from the same weights:
dequant(quant(w)) is exactly what the packed bytes decode to, and the inputs are rounded by the same function.

Legend: M routed rows, K in features, N out features, E experts, L latent width, I expert intermediate.
"""

from __future__ import annotations

import torch
from torch import nn

from ..config import K3Config
from ..layers.width.latent_moe import ExpertBank, LatentMoE, route_to_experts
from ..ops._triton import triton_available
from ..ops.mx import BLOCK, E4M3, dequantize_mxfp4, mx_round, quantize_mxfp4
from ..ops.situ import glu

__all__ = ["PackedWeight", "PackedExpertBank", "pack_experts", "packed_grouped_mm", "packed_grouped_mm_reference"]


class PackedWeight(nn.Module):
    """E experts' MXFP4 matrices [E,N,K] as the release stores each one: ``weight_packed`` uint8 [E,N,K/2] (element
    2i in the low nibble) and ``weight_scale`` uint8 [E,N,K/32] (E8M0, 2^(s-127))."""

    def __init__(self, num_experts: int, out_features: int, in_features: int):
        super().__init__()
        if in_features % BLOCK:
            raise ValueError(f"MXFP4 blocks are {BLOCK} input features: in_features={in_features} is not a multiple")
        E, N, K = num_experts, out_features, in_features
        self.register_buffer("weight_packed", torch.zeros(E, N, K // 2, dtype=torch.uint8))
        self.register_buffer("weight_scale", torch.zeros(E, N, K // BLOCK, dtype=torch.uint8))

    def extra_repr(self) -> str:
        E, N, half = self.weight_packed.shape
        return f"experts={E}, out={N}, in={2 * half}, MXFP4"

    @torch.no_grad()
    def pack(self, w: torch.Tensor) -> None:
        """Quantise float weights w [E,N,K] into this module (round to nearest even, OCP scale)."""
        packed, scale = quantize_mxfp4(w)
        self.weight_packed.copy_(packed)
        self.weight_scale.copy_(scale)


class PackedExpertBank(nn.Module):
    """ExpertBank's contract with the routed experts packed: w1 (gate) and w3 (up) [E,I,L], w2 (down) [E,L,I]."""

    def __init__(self, config: K3Config):
        super().__init__()
        E, L, I = config.num_experts, config.expert_dim, config.moe_intermediate_size
        self.w1, self.w3, self.w2 = PackedWeight(E, I, L), PackedWeight(E, I, L), PackedWeight(E, L, I)
        self.num_experts = E
        self.act = config.hidden_act
        self.b1, self.b2 = config.activation_situ_beta, config.activation_situ_linear_beta

    @classmethod
    def from_bank(cls, bank: ExpertBank, config: K3Config) -> "PackedExpertBank":
        packed = cls(config).to(bank.w1.device)
        for name in ("w1", "w3", "w2"):
            getattr(packed, name).pack(getattr(bank, name).detach())
        return packed

    def forward(self, z: torch.Tensor, weights: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        """z [N,L], weights/idx [N,k] -> sum_j w_j E_j(z) [N,L] in fp32."""
        return route_to_experts(z, weights, idx, self.num_experts, self.compute)

    @torch.no_grad()
    def compute(self, x: torch.Tensor, counts: torch.Tensor, row_weights: torch.Tensor | None = None) -> torch.Tensor:
        """x [M,L] sorted by expert, counts [E], row_weights [M,1] -> [M,L]: MXFP8 inputs times MXFP4 weights, each
        row's routing weight on the down projection's (quantised) input, as the QAT forward (``expert_glu``) has it."""
        x = mx_round(x, E4M3)
        h = glu(packed_grouped_mm(x, self.w1, counts), packed_grouped_mm(x, self.w3, counts), self.act, self.b1,
                self.b2)
        h = mx_round(h, E4M3)
        if row_weights is not None:
            h = (h * row_weights).to(h.dtype)
        return packed_grouped_mm(h, self.w2, counts)


def packed_grouped_mm(x: torch.Tensor, w: PackedWeight, counts: torch.Tensor, backend: str = "auto") -> torch.Tensor:
    """x [M,K] sorted by expert, counts [E] -> x @ w_e^T per expert group [M,N]. ``backend``: "triton" (CUDA, or CPU
    under TRITON_INTERPRET=1), "torch" (the reference), "auto" (Triton on CUDA when it is installed)."""
    if backend not in ("auto", "triton", "torch"):
        raise ValueError(f"backend must be 'auto', 'triton' or 'torch'; got {backend!r}")
    if backend == "triton" or (backend == "auto" and x.is_cuda and triton_available()):
        from .triton_mm import triton_packed_grouped_mm

        return triton_packed_grouped_mm(x, w.weight_packed, w.weight_scale, counts)
    return packed_grouped_mm_reference(x, w.weight_packed, w.weight_scale, counts)


def packed_grouped_mm_reference(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor,
                                counts: torch.Tensor) -> torch.Tensor:
    """The pure-torch reference: each expert's [N,K] weight is decoded (in x's dtype) only for its own rows."""
    ps, ss = packed.unbind(0), scale.unbind(0)
    outs = [xe @ dequantize_mxfp4(ps[e], ss[e], x.dtype).T for e, xe in enumerate(x.split(counts.tolist()))
            if xe.shape[0]]
    return torch.cat(outs) if outs else x.new_zeros(0, packed.shape[1])


def pack_experts(model: nn.Module, quantize: bool = True) -> nn.Module:
    """Replace every LatentMoE's ExpertBank by a PackedExpertBank holding its weights quantised to MXFP4 (in place;
    returns ``model``). Serving only: the packed bank has no parameters to train. ``quantize=False`` builds the
    packed layout only, on the bank's device (meta for a model to be filled by ``load_state_dict(assign=True)``)."""
    config = model.config
    for mod in list(model.modules()):
        if isinstance(mod, LatentMoE) and isinstance(mod.experts, ExpertBank):
            if quantize:
                mod.experts = PackedExpertBank.from_bank(mod.experts, config)
            else:
                with torch.device(mod.experts.w1.device):
                    mod.experts = PackedExpertBank(config)
    return model
