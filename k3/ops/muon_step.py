"""Muon's elementwise passes as one kernel each (SPEC §5): the momentum into the Newton-Schulz batch, the update
back into the weight.

A parameter's blocks (heads, experts, or the whole matrix; transposed when tall, so every block of a batch has one
orientation) are a strided view [N, R, C] of its storage; the batch slot is [N, R, C], contiguous, in the batch's
dtype (bf16 on CUDA).

    momentum:  buf <- lerp(buf, g, 1 - mu);  slot <- round(lerp(g, buf, mu))   (Nesterov; else slot <- round(buf))
    update:    p   <- p * decay + alpha * slot                                   (decay = 1 - lr wd, alpha = -lr s)

Unfused, these are two foreach lerps over the gradients and momenta, a copy of each gradient into the batch (cast
and transpose), then a foreach multiply and an add of each update into its weight (a copy first where the update's
layout is not the weight's): six passes, ~54 bytes moved per fp32 element. Fused, each is one pass reading and
writing each element once (~14 and ~10 bytes), and the update is read from the batch in place (no copy back to the
weight's layout). On CUDA one Triton kernel each; elsewhere the same math as torch ops (the reference).
"""

from __future__ import annotations

import torch

from ._triton import triton_available

__all__ = ["fused_applies", "momentum_into", "apply_update"]


def fused_applies(t: torch.Tensor) -> bool:
    """The Triton kernels take this tensor (a plain CUDA tensor, not a DTensor shard; Triton importable)."""
    return t.is_cuda and type(t) is torch.Tensor and triton_available()


def momentum_into(g: torch.Tensor, buf: torch.Tensor, slot: torch.Tensor, mu: float, nesterov: bool) -> None:
    """Update the momentum ``buf`` in place from the gradient ``g`` and write the step's direction into ``slot``.
    ``g``, ``buf``: [N, R, C] views with the same strides; ``slot``: contiguous [N, R, C]. ``g`` is not changed."""
    _check(g, buf, slot)
    if fused_applies(g):
        from ._muon_triton import momentum

        return momentum(g, buf, slot, mu, nesterov)
    buf.lerp_(g, 1 - mu)
    slot.copy_(torch.lerp(g, buf, mu) if nesterov else buf)


def apply_update(p: torch.Tensor, slot: torch.Tensor, decay: float, alpha: float) -> None:
    """p <- p * decay + alpha * slot, in place; ``p``: [N, R, C] view of the weight, ``slot``: contiguous [N, R, C]."""
    _check(p, p, slot)
    if fused_applies(p):
        from ._muon_triton import update

        return update(p, slot, decay, alpha)
    p.mul_(decay).add_(slot, alpha=alpha)


def _check(a: torch.Tensor, b: torch.Tensor, slot: torch.Tensor) -> None:
    if a.dim() != 3 or a.shape != b.shape or a.shape != slot.shape or a.stride() != b.stride():
        raise ValueError(f"muon_step: need [N, R, C] views of one layout and a slot of their shape; got "
                         f"{tuple(a.shape)} {a.stride()}, {tuple(b.shape)} {b.stride()}, slot {tuple(slot.shape)}")
    if not slot.is_contiguous():
        raise ValueError(f"muon_step: the batch slot must be contiguous, got strides {slot.stride()}")
