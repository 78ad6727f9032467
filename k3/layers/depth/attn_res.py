"""Attention Residuals bookkeeping (SPEC §3): the depth stream every sub-layer reads from and writes to.

Sources are counted in SUB-layers (attention, FFN). K3's block of 12 decoder layers is 24 sub-layers; a
block size of 1 sub-layer makes every sub-layer output its own source, which is full AttnRes. The order
matches the official forward: a sub-layer first mixes [completed blocks..., partial sum], then, at a block
boundary, the partial is sealed into a block, then the sub-layer's output starts/extends the partial.

Legend: B batch, T time, D hidden.
"""

from __future__ import annotations

import torch
from torch import nn

from ...config import K3Config
from ...ops.attn_res import SourceGrad, attn_res_mix_norm, seal_source, uses_kernel
from ...ops.regions import region
from ..norm import RMSNorm


class PseudoQuery(nn.Module):
    """One AttnRes pseudo-query: ``proj`` (Linear D->1, zero init: uniform mixing) and the key ``norm``."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.proj = nn.Linear(dim, 1, bias=False)
        nn.init.zeros_(self.proj.weight)
        self.norm = RMSNorm(dim, eps)


class DepthStream:
    """Holds the sources of one forward pass. mode: "block"/"full" (AttnRes) or "none" (plain residual).

    A subclass may keep a sub-layer's write ``pending`` and add it inside the next read's mix (inference's
    ``k3.inference.fast.PendingDepthStream``): the running sum of the current block is then ``partial + pending``.
    Here every write is added at once and ``pending`` stays None."""

    def __init__(self, embedding: torch.Tensor, mode: str, block_size: int, eps: float):
        self.mode, self.block_size, self.eps = mode, block_size, eps
        self.blocks: list[torch.Tensor] = []  # sealed blocks b_0 (the embedding), b_1, ...
        self.sinks: dict[int, SourceGrad] = {}  # id(block) -> where the mixes' kernels sum its gradient
        self.partial: torch.Tensor | None = embedding  # running sum of the current block (less ``pending``)
        self.pending: torch.Tensor | None = None  # a written sub-layer output not yet added to ``partial``
        self.sublayer = 0

    def read(self, query: PseudoQuery | None, norm: nn.Module | None = None) -> torch.Tensor:
        """The input of the next sub-layer, through the sub-layer's pre-norm ``norm`` when given; seals a block when
        the sub-layer opens a new one."""
        if self.mode == "none":
            return self.partial if norm is None else norm(self.partial)
        h = self._mix_sources(query, norm)
        if self.sublayer % self.block_size == 0 and self.partial is not None:
            block, sink = self.partial, None
            if uses_kernel([block]):  # every later mix's kernel reads it: their gradients summed in place
                block, sink = seal_source(block)
            self.blocks.append(block)
            if sink is not None:
                self.sinks[id(block)] = sink
            self.partial = None
        self.sublayer += 1
        return h

    @classmethod
    def of(cls, embedding: torch.Tensor, config: K3Config) -> "DepthStream":
        """The stream of a forward of a model with ``config``, starting from the embedding [B,T,D]."""
        return cls(embedding, config.attn_res, cls.sublayer_block_size(config.attn_res, config.attn_res_block_size),
                   config.rms_norm_eps)

    def write(self, out: torch.Tensor) -> None:
        if self.partial is None:
            self.partial = out
        else:
            self._add_pending()
            self.partial = self.partial + out

    def output(self, query: PseudoQuery | None) -> torch.Tensor:
        """The final mix (output pseudo-query) before the last norm."""
        if self.mode == "none":
            return self.partial
        return self._mix_sources(query)

    def _mix_sources(self, query: PseudoQuery, norm: nn.Module | None = None) -> torch.Tensor:
        """The mix of blocks + [partial] (a pending write added first), through ``norm`` when given; one source is
        itself."""
        self._add_pending()
        sources = self.blocks + ([self.partial] if self.partial is not None else [])
        if len(sources) > 1:
            return self._mix(query, sources, norm)
        return sources[0] if norm is None else norm(sources[0])

    def _add_pending(self) -> None:
        if self.pending is not None:
            self.partial, self.pending = self.partial + self.pending, None

    def _mix(self, query: PseudoQuery, sources: list[torch.Tensor], norm: nn.Module | None = None) -> torch.Tensor:
        """The "attn_res" region (k3.ops.regions): the mix and the sub-layer's pre-norm. Its inputs are the
        sources themselves (blocks built once, at their boundary, and shared by every later read; the partial sum is
        the residual stream), so a policy that recomputes it keeps nothing of its own: a layer then saves exactly
        what a plain residual layer saves (tests/train/test_memory.py)."""
        sinks = tuple(self.sinks.get(id(x)) for x in sources) if uses_kernel(sources) else None  # (kernel's only)
        return region("attn_res", _mix_and_norm, self.eps, query.proj.weight, query.norm.weight, norm, sinks,
                      *sources)

    @staticmethod
    def sublayer_block_size(mode: str, decoder_block_size: int) -> int:
        return 1 if mode == "full" else 2 * decoder_block_size


def _mix_and_norm(eps: float, proj_weight: torch.Tensor, key_norm_weight: torch.Tensor, norm: RMSNorm | None,
                  sinks, *sources: torch.Tensor) -> torch.Tensor:
    return attn_res_mix_norm(list(sources), proj_weight[0], key_norm_weight, eps,
                             norm.weight if norm is not None else None, norm.eps if norm is not None else 0.0, sinks)
