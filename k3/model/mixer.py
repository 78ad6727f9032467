"""The mixer hook: how code above the model supplies a decoder layer's sub-layers (SPEC §7, §8).

``K3Model.forward(..., mixer=m)`` hands three things of every forward to ``m``:

  - ``m.attend(layer, x) -> y``: the token mixer (KDA or MLA) of ``layer`` on x [B,T,D]: where its state, its keys
    and its kernels come from (inference's pages, context parallelism's halos and scans). Required. Called with
    ``stats=`` as well when the forward records statistics (``k3.layers.stats``): a mixer that trains takes it;
  - ``m.ffn(layer, x, stats=None) -> y``: the FFN sub-layer (dense MLP or LatentMoE); default the layer's own;
  - ``m.depth_stream(embedding, config) -> DepthStream``: the AttnRes stream of the forward; default the plain one.

and, to ``K3ForCausalLM.forward``, its view of the sequence: ``tokens(ids)`` the part of a [B,T] row the forward
runs, ``shifted(ids, shift, cu_seqlens, fill)`` each of those positions' token ``shift`` ahead, ``mean(total,
count)`` the loss's mean. By default the forward runs the whole row; context parallelism (``k3.distributed.
context_parallel``) gives every rank the global row and takes its share of each.

Without a mixer every layer runs its own forward: one path, training's and the reference. Inference's fast paths
(fused projections, the decode kernels, the deferred residual add) are its mixers' (``k3.inference.fast``).
Subclass ``Mixer`` and override what you supply; a new hook gets a default here, so that every mixer keeps working.
"""

from __future__ import annotations

import torch

from ..config import K3Config
from ..layers.depth.attn_res import DepthStream
from ..ops.varlen import same_document


class Mixer:
    def attend(self, layer, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError(f"{type(self).__name__} supplies no token mixer: define attend(layer, x)")

    def ffn(self, layer, x: torch.Tensor, stats=None) -> torch.Tensor:
        return layer.ffn(x, stats)

    def depth_stream(self, embedding: torch.Tensor, config: K3Config) -> DepthStream:
        return DepthStream.of(embedding, config)

    def tokens(self, ids: torch.Tensor) -> torch.Tensor:
        return ids

    def shifted(self, ids: torch.Tensor, shift: int, cu_seqlens: torch.Tensor | None, fill: int | None = -100):
        """ids [B,T] -> [B,T]: at every position t the token t + shift where it lies in t's document (and the row),
        else ``fill`` (None: the token t itself). The targets of a loss ``shift`` ahead (fill -100, ignored)."""
        keep = same_document(ids.shape[1], shift, cu_seqlens, ids.device)  # no boolean indexing: no wait for the device
        return torch.where(keep, torch.roll(ids, -shift, dims=1), ids if fill is None else fill)

    def mean(self, total: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
        return total / count
