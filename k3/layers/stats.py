"""What a training forward reports besides its output (SPEC §4.1, §5), gathered layer by layer and returned in the
model's output (``CausalLMOutput.max_logit`` / ``.routing``), never left on the modules.

Legend: H heads, N tokens, E experts, k top-k.
"""

from __future__ import annotations

import torch

STATISTICS = ("max_logit", "routing")


class Statistics:
    """One forward's statistics, keyed by decoder-layer index (MTP layers follow the trunk's):

    - ``max_logit`` {GatedMLA layer: [H] fp32}: each head's largest pre-softmax logit, for QK-clip (SPEC §5);
    - ``routing`` {LatentMoE layer: (scores [N,E] fp32, idx [N,k])}, detached, for Quantile Balancing (SPEC §4.1).

    A field is None when the caller did not ask for it (``record``, a subset of ``STATISTICS``); a layer records
    only the fields that are not None."""

    def __init__(self, record=()):
        unknown = set(record) - set(STATISTICS)
        if unknown:
            raise ValueError(f"unknown statistics {sorted(unknown)}; expected some of {STATISTICS}")
        self.max_logit: dict[int, torch.Tensor] | None = {} if "max_logit" in record else None
        self.routing: dict[int, tuple[torch.Tensor, torch.Tensor]] | None = {} if "routing" in record else None

    def add_max_logit(self, layer: int, m: torch.Tensor) -> None:
        """The running max of layer ``layer``'s per-head maxima (a layer may attend more than once per forward)."""
        prev = self.max_logit.get(layer)
        self.max_logit[layer] = m if prev is None else torch.maximum(prev, m)

    def add_routing(self, layer: int, scores: torch.Tensor, idx: torch.Tensor) -> None:
        self.routing[layer] = (scores.detach(), idx.detach())


def merge_max_logits(a: dict | None, b: dict | None) -> dict | None:
    """Two micro-batches' ``max_logit`` dicts -> their per-layer, per-head maximum, in new tensors (a replayed CUDA
    graph rewrites its outputs in place)."""
    if not b:
        return a
    out = dict(a or {})
    for layer, m in b.items():
        out[layer] = m.clone() if layer not in out else torch.maximum(out[layer], m)
    return out
