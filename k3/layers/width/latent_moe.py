"""Stable LatentMoE (SPEC §4): routed experts in a half-width latent space, RMSNorm on their sum, and
full-width shared experts.

Legend: N tokens, D hidden, L latent width (= D for a plain MoE), I expert intermediate, E experts, k top-k,
M = N*k routed rows. y = shared(x) + W_up RMSNorm(sum_j p_j E_j(W_down x)).
With ``config.qat = "mxfp4"`` (SPEC §6) each expert's weights are MXFP4 and its matmul inputs MXFP8 in the forward
(fake-quantised, straight-through gradients): the bf16/fp32 weights stay the optimiser's masters.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ...config import K3Config
from ...ops.grouped_mm import grouped_mm
from ...ops.mx import fake_quant_mxfp4, fake_quant_mxfp8
from ...ops.regions import region
from ...ops.routing import bincount, combine_rows, dispatch_rows, inverse_permutation
from ...ops.situ import glu
from ..fuse import fuse_linears
from ..norm import RMSNorm
from ..stats import Statistics
from .mlp import GatedMLP
from .router import Router


class ExpertBank(nn.Module):
    """All routed experts as 3-D tensors: w1 (gate) and w3 (up) [E,I,L], w2 (down) [E,L,I].

    The checkpoint stores them per expert as ``experts.{e}.w{1,2,3}.weight``; k3.checkpoint converts.
    """

    routed_experts = True  # the optimiser orthogonalises each expert's matrix separately

    def __init__(self, config: K3Config):
        super().__init__()
        E, L, I = config.num_experts, config.expert_dim, config.moe_intermediate_size
        self.w1 = nn.Parameter(torch.empty(E, I, L))
        self.w3 = nn.Parameter(torch.empty(E, I, L))
        self.w2 = nn.Parameter(torch.empty(E, L, I))
        for w in (self.w1, self.w3, self.w2):
            nn.init.uniform_(w, -1 / math.sqrt(w.shape[-1]), 1 / math.sqrt(w.shape[-1]))
        self.act = config.hidden_act
        self.b1, self.b2 = config.activation_situ_beta, config.activation_situ_linear_beta
        self.qat = config.qat

    def forward(self, z: torch.Tensor, weights: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        """z [N,L], weights/idx [N,k] -> sum_j w_j E_j(z) [N,L] in fp32.

        The routing weight scales each row BEFORE the down projection, w (h W2^T) = (w h) W2^T: autograd then
        saves h and w h [M,I] in the compute dtype instead of the expert output [M,L] in fp32, and forms the
        weight's gradient as rowsum(h * (dy W2)) from the act output and the gradient the down projection needs
        anyway (SonicMoE's rewrite); equal to weighting afterwards up to float rounding. (A decode step's few rows
        take fused kernels instead: k3.inference.fast.)"""
        return route_to_experts(z, weights, idx, self.w1.shape[0], self.compute)

    def compute(self, x: torch.Tensor, counts: torch.Tensor, row_weights: torch.Tensor | None = None) -> torch.Tensor:
        """x [M,L] sorted by expert, counts [E], row_weights [M,1] (or None) -> each row's expert output [M,L]."""
        return expert_glu(x, counts, self.w1, self.w3, self.w2, self.act, self.b1, self.b2, self.qat, row_weights)


def route_to_experts(z: torch.Tensor, weights: torch.Tensor, idx: torch.Tensor, num_experts: int, experts):
    """z [N,L], weights/idx [N,k] -> sum_j w_j E_j(z) [N,L] fp32; ``experts(x [M,L] sorted by expert, counts [E],
    row_weights [M,1])`` computes every routed row scaled by its routing weight (a bank's ``compute``)."""
    k = idx.shape[1]
    flat = idx.reshape(-1)
    order = flat.argsort(stable=True)  # slots grouped by expert
    inverse = inverse_permutation(order)
    counts = bincount(flat, num_experts)
    out = experts(dispatch_rows(z, order, inverse, k), counts, weights.reshape(-1)[order, None])
    return combine_rows(out, order, inverse, k)


def expert_glu(x, counts, w1, w3, w2, act: str, b1: float, b2: float, qat: str | None = None,
               row_weights: torch.Tensor | None = None) -> torch.Tensor:
    """x [M,L] sorted by expert, counts [E], w1/w3 [E,I,L], w2 [E,L,I] -> each row's SiTU-GLU expert [M,L], scaled
    by ``row_weights`` [M,1] when given (on the down projection's input: ExpertBank.forward says why).
    ``qat="mxfp4"``: MXFP4 weights and MXFP8 matmul inputs, fake-quantised (SPEC §6); the routing weight then
    scales the quantised input, as serving scales the packed matmul's output."""
    if qat is not None:
        w1, w3, w2, x = fake_quant_mxfp4(w1), fake_quant_mxfp4(w3), fake_quant_mxfp4(w2), fake_quant_mxfp8(x)
    # gate and up as ONE grouped matmul over their weights side by side [E, 2I, L] (cast to x's dtype first, as
    # grouped_mm would): x is read once, the GEMM is twice as wide, and x's gradient is one GEMM, not two and an add
    gate, up = grouped_mm(x, torch.cat([w1.to(x.dtype), w3.to(x.dtype)], dim=1), counts).chunk(2, dim=-1)
    h = glu(gate, up, act, b1, b2)
    if qat is not None:
        h = fake_quant_mxfp8(h)
    if row_weights is not None:
        h = (h * row_weights).to(h.dtype)  # [M,I]; bf16 stays bf16 for the fused matmul
    return grouped_mm(h, w2, counts)


class LatentMoE(nn.Module):
    def __init__(self, config: K3Config, layer_idx: int = 0):
        super().__init__()
        D = config.hidden_size
        self.layer_idx = layer_idx  # names its routing in the forward's Statistics
        self.gate = Router(config)
        if config.latent_moe:
            L = config.routed_expert_hidden_size
            self.routed_expert_down_proj = nn.Linear(D, L, bias=False)
            self.routed_expert_up_proj = nn.Linear(L, D, bias=False)
            self.routed_expert_norm = RMSNorm(L, config.rms_norm_eps) if config.latent_moe_use_norm else None
        else:
            self.routed_expert_down_proj = self.routed_expert_up_proj = self.routed_expert_norm = None
        self.experts = ExpertBank(config)
        shared = config.moe_intermediate_size * config.num_shared_experts
        self.shared_experts = GatedMLP(config, D, shared) if shared else None
        self.in_proj: torch.Tensor | None = None  # down projection and shared gate/up in one (fuse_projections)
        self.out_proj: torch.Tensor | None = None  # latent up projection and shared down in one (fuse_projections)

    def fuse_projections(self) -> None:
        """Inference: the latent down projection and the shared experts' gate and up projections become one
        matmul (the router stays apart: it is computed in fp32), and so do the latent up projection and the shared
        experts' down projection, whose outputs are summed: [u, h_shared] times both weights side by side."""
        lins = [self.routed_expert_down_proj] if self.routed_expert_down_proj is not None else []
        if self.shared_experts is not None:
            lins += [self.shared_experts.gate_proj, self.shared_experts.up_proj]
        if len(lins) > 1:
            self.in_proj, self._in_sizes = fuse_linears(lins)
        if self.shared_experts is not None:  # its gate and up rows, so that it is not fused a second time
            self.shared_experts.in_proj = self.in_proj[-sum(self._in_sizes[-2:]):]
            self.shared_experts._in_sizes = self._in_sizes[-2:]
        if self.shared_experts is not None and self.routed_expert_up_proj is not None:
            self.out_proj, _ = fuse_linears([self.routed_expert_up_proj, self.shared_experts.down_proj], by_input=True)

    def forward(self, x: torch.Tensor, stats: Statistics | None = None) -> torch.Tensor:
        """x [...,D] -> [...,D]. ``stats``: where the routing goes when it asks for it (Quantile Balancing). The
        fused projections and a decode step's kernels are inference's (k3.inference.fast)."""
        shape = x.shape
        x = x.reshape(-1, shape[-1])  # [N,D]
        weights, idx, scores = self.gate(x)
        if stats is not None and stats.routing is not None:
            stats.add_routing(self.layer_idx, scores, idx)
        z = self.routed_expert_down_proj(x) if self.routed_expert_down_proj is not None else x
        u = region("moe_experts", self.experts, z, weights, idx)  # [N,L] fp32; recomputable from the dispatch input
        u = self.latent_norm(u, x.dtype)
        y = self.routed_expert_up_proj(u) if self.routed_expert_up_proj is not None else u
        if self.shared_experts is not None:
            y = y + self.shared_experts(x)
        return y.reshape(shape)

    def latent_norm(self, u: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The routed experts' sum u [N,L] fp32 -> the latent RMSNorm (when the layer has it) -> ``dtype``."""
        if self.routed_expert_norm is not None:
            u = self.routed_expert_norm(u)
        return u.to(dtype)
