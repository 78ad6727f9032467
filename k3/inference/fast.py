"""Inference's fast paths through the mixer hook (``k3.model.mixer``): what a prefill or decode step runs instead of
the layers' own forwards, with no gradient. Each is the layer's arithmetic in fewer, larger kernels; the layer's own
forward (training's, and the reference) stays the one path of the layer. The engine's mixers
(``k3.inference.mixers``) are ``InferenceMixer``s.

Legend: N rows (tokens), D hidden, L latent width, Is shared experts' intermediate, k top-k, H heads, K head dim.

- Fused projections (``K3ForCausalLM.fuse_projections``, ``k3.layers.fuse``): each layer's projections of one input
  as one matmul over its ``in_proj`` (``fused_parts``), the MoE's latent up and shared down projections as one over
  its ``out_proj``.
- FFN (``moe_ffn``, ``dense_ffn``): a few tokens on CUDA route in one kernel (``k3.ops.router_decode``), run their
  experts in two (``k3.ops.moe_decode``) and, at ``MOE_ROWS`` rows or fewer, the k-sum, latent norm, shared
  activation and fused output projection in one more (``k3.ops.proj_decode``).
- KDA's output (``kda_output``): at ``KDA_ROWS`` rows or fewer on CUDA, the gated norm and o_proj in one kernel.
- Depth (``PendingDepthStream``): a sub-layer's write kept pending and added inside the next read's mix kernel
  (``k3.ops.attn_res.attn_res_add_mix_norm``): one launch and one pass over the partial sum instead of two.
Where a kernel does not apply (CPU, more rows, a packed MXFP4 bank, a QAT bank) the same arithmetic runs unfused.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..config import K3Config
from ..layers.depth.attn_res import DepthStream
from ..layers.width.latent_moe import ExpertBank
from ..model.mixer import Mixer
from ..ops.attn_res import attn_res_add_mix_norm, kernel_applies
from ..ops.moe_decode import decode_applies, expert_decode
from ..ops.proj_decode import (KDA_ROWS, MOE_ROWS, kda_output_decode, kda_output_width, moe_output_decode,
                               moe_output_width, proj_decode_applies)
from ..ops.router_decode import router_decode, router_decode_applies

__all__ = ["InferenceMixer", "PendingDepthStream", "fused_parts", "moe_ffn", "dense_ffn", "kda_output", "route"]


class InferenceMixer(Mixer):
    """The FFN and depth fast paths of every inference step; subclasses supply ``attend``."""

    def ffn(self, layer, x: torch.Tensor, stats=None) -> torch.Tensor:
        return moe_ffn(layer.block_sparse_moe, x) if layer.is_moe else dense_ffn(layer.mlp, x)

    def depth_stream(self, embedding: torch.Tensor, config: K3Config) -> DepthStream:
        return PendingDepthStream.of(embedding, config)


def fused_parts(layer, x: torch.Tensor):
    """The outputs of ``layer``'s projections of x from its fused matmul (``in_proj``), split per projection; None
    when the layer was not fused (then the layer computes them itself)."""
    if layer.in_proj is None:
        return None
    return F.linear(x, layer.in_proj).split(layer._in_sizes, dim=-1)


def dense_ffn(mlp, x: torch.Tensor) -> torch.Tensor:
    """A GatedMLP: gate and up as one matmul when fused."""
    parts = fused_parts(mlp, x)
    return mlp(x) if parts is None else mlp.down_proj(mlp.activation(*parts))


def route(router, x: torch.Tensor):
    """``Router.forward`` (weights [N,k] fp32, idx [N,k], scores [N,E] fp32); a few tokens on CUDA: one kernel."""
    if router_decode_applies(x, router.top_k, router.score_func):
        return router_decode(x, router.weight, router.e_score_correction_bias, router.top_k, router.renormalize,
                             router.scaling)
    return router(x)


def expert_rows(bank, z: torch.Tensor, weights: torch.Tensor, idx: torch.Tensor) -> torch.Tensor | None:
    """A few routed rows on CUDA of a float bank: each row's weighted expert output [N,k,L] fp32 from two fused kernels
    (``k3.ops.moe_decode``); None where that path does not apply (a packed or QAT bank, more rows, CPU)."""
    if isinstance(bank, ExpertBank) and bank.qat is None and decode_applies(z, idx):
        return expert_decode(z, weights, idx, bank.w1, bank.w3, bank.w2, bank.act, bank.b1, bank.b2)
    return None


def expert_sum(bank, z: torch.Tensor, weights: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """sum_j w_j E_j(z) [N,L] fp32 (``ExpertBank.forward``), from the decode kernels where they apply."""
    rows = expert_rows(bank, z, weights, idx)
    return rows.sum(1) if rows is not None else bank(z, weights, idx)


def moe_ffn(moe, x: torch.Tensor) -> torch.Tensor:
    """``LatentMoE.forward`` of x [...,D] with the fused projections and the decode kernels where they apply."""
    shape = x.shape
    x = x.reshape(-1, shape[-1])  # [N,D]
    weights, idx, _ = route(moe.gate, x)
    down, up, shared = moe.routed_expert_down_proj, moe.routed_expert_up_proj, moe.shared_experts
    if moe.in_proj is None:  # not fused
        z = down(x) if down is not None else x
        u = moe.latent_norm(expert_sum(moe.experts, z, weights, idx), x.dtype)
        y = up(u) if up is not None else u
        return (y + shared(x) if shared is not None else y).reshape(shape)
    fused = F.linear(x, moe.in_proj)  # z and the shared experts' gate/up from one matmul
    parts = fused.split(moe._in_sizes, dim=-1)
    z = parts[0] if down is not None else x
    y = _moe_output_decode(moe, x, fused, z, weights, idx)
    if y is not None:
        return y.reshape(shape)
    h_shared = shared.activation(*parts[-2:])
    u = moe.latent_norm(expert_sum(moe.experts, z, weights, idx), x.dtype)
    if moe.out_proj is not None:  # up(u) + down(h_shared) as one matmul
        return F.linear(torch.cat([u, h_shared], dim=-1), moe.out_proj).reshape(shape)
    y = up(u) if up is not None else u
    return (y + shared.down_proj(h_shared)).reshape(shape)


def _moe_output_decode(moe, x, fused, z, weights, idx) -> torch.Tensor | None:
    """A decode step's few rows on CUDA: the routed experts' rows from their fused kernels, then ONE kernel for the
    sum over k, the latent norm, the shared experts' activation and the fused output projection
    (``k3.ops.proj_decode.moe_output_decode``). None where that path does not apply (then the general one)."""
    if moe.shared_experts is None or moe.routed_expert_up_proj is None or moe.out_proj is None:
        return None
    L, Is = moe._in_sizes[0], moe._in_sizes[-1]
    if not proj_decode_applies(x, x.shape[0], MOE_ROWS, moe.out_proj, moe_output_width(L, Is)):
        return None
    rows = expert_rows(moe.experts, z, weights, idx)
    if rows is None:
        return None
    norm, sh = moe.routed_expert_norm, moe.shared_experts
    return moe_output_decode(rows, fused, L, L + Is, Is, norm.weight if norm is not None else None,
                             norm.eps if norm is not None else 0.0, moe.out_proj, sh.act, sh.b1, sh.b2)


def kda_output(attn, o: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """``KimiDeltaAttention.output``; a few rows on CUDA: the gated norm and o_proj in one kernel."""
    B, T, H, K = o.shape
    w = attn.o_proj.weight
    if proj_decode_applies(o, B * T, KDA_ROWS, w, kda_output_width(H, K)) and gate.dtype == w.dtype:
        y = kda_output_decode(o.reshape(B * T, H, K), gate.reshape(B * T, H * K), attn.o_norm.weight, attn.o_norm.eps,
                              w)
        return y.view(B, T, -1)
    return attn.output(o, gate)


class PendingDepthStream(DepthStream):
    """A ``DepthStream`` whose writes, where the mix kernel takes them (CUDA, Triton), wait for the next read, which
    adds them inside its kernel (``attn_res_add_mix_norm``). Inference only: nothing here records gradients."""

    def write(self, out: torch.Tensor) -> None:
        if self.partial is not None and self.pending is None and self.mode != "none" and \
                kernel_applies([self.partial, out]):
            self.pending = out  # added by the next read's kernel
        else:
            super().write(out)

    def _mix_sources(self, query, norm=None) -> torch.Tensor:
        if self.pending is None or not self.blocks:
            return super()._mix_sources(query, norm)
        h, self.partial = attn_res_add_mix_norm(self.blocks + [self.partial], self.pending, query.proj.weight[0],
                                                query.norm.weight, self.eps, norm.weight if norm is not None else None,
                                                norm.eps if norm is not None else 0.0)
        self.pending = None
        return h
