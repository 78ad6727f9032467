"""Named activation regions (SPEC §8, memory): light annotations that a training-time storage policy acts on.

A layer marks a piece of its forward as ``region(name, fn, *args)``. Without a handler (inference, evaluation,
plain use) that is ``fn(*args)``. ``k3.train.memory.ActivationManager`` installs a handler for the training
forward that decides how the tensors saved for backward inside the region are stored (kept, recomputed from the
region's inputs in the backward, or offloaded), so how memory is saved never lives in the model code; and
``k3.train.compile`` may install a compiler that replaces ``fn`` by its compiled form (``k3 train --compile``).

Regions: "attn_res" (an AttnRes mix over the depth sources, k3.layers.depth), "moe_experts" (a LatentMoE's routed
dispatch, expert matmuls and combine, k3.layers.width.latent_moe), "kda_activations" (KDA's L2 norms of q and k,
its forget gate and beta, between the short convs and the recurrence, k3.layers.sequence.kda), "mla_output" (MLA's
sigmoid output gate on the attention output, k3.layers.sequence.mla), "lm_loss" (the LM head and cross-entropy of one
chunk of tokens in a training loss, k3.ops.linear_ce via k3.model.transformer).

The registry sits in ops, the lowest layer, because an op (``linear_ce``) marks a region as well as the layers do.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

__all__ = ["REGIONS", "region", "region_handler", "set_region_compiler"]

REGIONS = ("attn_res", "moe_experts", "kda_activations", "mla_output", "lm_loss")

_handler = None  # (name, fn, *args) -> fn's result, or None: a plain call
_compiler = None  # (name, fn) -> the function to run instead of fn, or None


def region(name: str, fn, *args):
    """``fn(*args)`` (compiled when a compiler is installed), through the installed handler while one is (and
    autograd records)."""
    if _compiler is not None:
        fn = _compiler(name, fn)
    if _handler is None or not torch.is_grad_enabled():
        return fn(*args)
    return _handler(name, fn, *args)


def set_region_compiler(compiler):
    """Install ``compiler(name, fn) -> fn'`` for every region from now on (None removes it); returns the previous."""
    global _compiler
    previous, _compiler = _compiler, compiler
    return previous


@contextmanager
def region_handler(handler):
    """Install ``handler(name, fn, *args)`` for the regions run inside the ``with`` block."""
    global _handler
    previous, _handler = _handler, handler
    try:
        yield
    finally:
        _handler = previous
