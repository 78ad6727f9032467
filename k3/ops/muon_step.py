"""Muon's elementwise passes as one kernel each per bucket (SPEC §5): the momentum into the Newton-Schulz batch, the
update back into the weights, and Newton-Schulz's own (the normalisation of each block, a I + b G per iteration).

A parameter's blocks (heads, experts, or the whole matrix; transposed when tall, so every block of a batch has one
orientation) are a strided view [N, R, C] of its storage; its slot in the batch is [N, R, C], contiguous, in the
batch's dtype (bf16 on CUDA). For each tensor i of a bucket:

    momentum:  g_i <- scale g_i (optional: clipping);  buf_i <- lerp(buf_i, g_i, 1 - mu_i);
               slot_i <- round(lerp(g_i, buf_i, mu_i))                  (Nesterov; else buf_i)
    update:    p_i   <- p_i * decay_i + alpha_i * slot_i                   (decay = 1 - lr wd, alpha = -lr 0.2 sqrt(n))

On CUDA each pass is one Triton launch per memory order in the bucket (every tile of every tensor whose rows, or
whose columns, are contiguous; ``k3.ops._muon_triton``),
reading and writing each element once (~14 and ~10 bytes per fp32 element) and the update read from the batch in
place: against two foreach lerps, a cast-and-transpose copy of each gradient into the batch, a foreach multiply and
an add of each update (~54 bytes per element, ~2 launches per parameter: the optimiser step of a small model is
bound by its launches). Elsewhere the same math as torch ops, tensor by tensor (the reference).
"""

from __future__ import annotations

import torch

from ._triton import triton_available

__all__ = ["fused_applies", "kernel_types", "momentum_into", "apply_update", "normalized_blocks", "ns_polynomial"]


def kernel_types(tensors: list[torch.Tensor]) -> bool:
    """Plain tensors or parameters (a whole expert bank's view is the parameter itself), not subclasses such as
    DTensor shards, whose data the kernels' raw addresses would not reach."""
    return all(type(t) in (torch.Tensor, torch.nn.Parameter) for t in tensors)


def fused_applies(tensors: list[torch.Tensor]) -> bool:
    """The Triton kernels take these tensors: CUDA, of ``kernel_types``, Triton importable."""
    return all(t.is_cuda for t in tensors) and kernel_types(tensors) and triton_available()


def momentum_into(grads: list[torch.Tensor], bufs: list[torch.Tensor], slots: list[torch.Tensor], mus: list[float],
                  nesterovs: list[bool], scale: torch.Tensor | None = None) -> None:
    """Update each momentum ``bufs[i]`` in place from ``grads[i]`` and write the step's direction into ``slots[i]``.
    grads[i], bufs[i]: [N, R, C] views with the same strides; slots[i]: contiguous [N, R, C]. Gradients are read,
    not written. ``scale``: a 0-d tensor on their device every gradient is multiplied by first (g <- scale g:
    gradient clipping's coefficient)."""
    _check(grads, bufs, slots, mus, nesterovs)
    if not grads:
        return
    if scale is not None and (scale.numel() != 1 or scale.device != grads[0].device):
        raise ValueError(f"muon_step: scale must be one number on the gradients' device {grads[0].device}; got shape "
                         f"{tuple(scale.shape)} on {scale.device}")
    if fused_applies(grads + bufs + slots) and _one_dtype(grads + bufs) and _one_dtype(slots):
        from ._muon_triton import momentum

        return momentum(grads, bufs, slots, mus, nesterovs, scale)
    for g, b, s, mu, nesterov in zip(grads, bufs, slots, mus, nesterovs):
        if scale is not None:
            g = g * scale.to(g.dtype)
        b.lerp_(g, 1 - mu)
        s.copy_(torch.lerp(g, b, mu) if nesterov else b)


def apply_update(params: list[torch.Tensor], slots: list[torch.Tensor], decays: list[float],
                 alphas: list[float]) -> None:
    """params[i] <- params[i] * decays[i] + alphas[i] * slots[i], in place; params[i]: [N, R, C] views of the
    weights, slots[i]: contiguous [N, R, C]."""
    _check(params, params, slots, decays, alphas)
    if not params:
        return
    if fused_applies(params + slots) and _one_dtype(params) and _one_dtype(slots):
        from ._muon_triton import update

        return update(params, slots, decays, alphas)
    for p, s, decay, alpha in zip(params, slots, decays, alphas):
        p.mul_(decay).add_(s, alpha=alpha)


def normalized_blocks(G: torch.Tensor, eps: float, dtype: torch.dtype) -> torch.Tensor:
    """Newton-Schulz's start: each block of G [N, A, B] over its Frobenius norm, in ``dtype``:

        X_n = G_n / max(||G_n||_F, eps)

    in fp32 arithmetic, rounded once into ``dtype``: on CUDA two Triton launches for the whole batch (partial sums of
    squares, then the scaling, which also casts); elsewhere torch ops (the reference)."""
    if G.dim() != 3:
        raise ValueError(f"normalized_blocks: need blocks [N, A, B], got shape {tuple(G.shape)}")
    if fused_applies([G]) and G.dtype in (torch.float32, torch.bfloat16, torch.float16):
        from ._muon_triton import normalize_blocks

        return normalize_blocks(G.contiguous(), eps, dtype)
    norm = torch.linalg.vector_norm(G, dim=(-2, -1), keepdim=True, dtype=torch.float32)
    return (G.float() * (1.0 / norm.clamp(min=eps))).to(dtype)


def ns_polynomial(gram: torch.Tensor, a: float, b: float) -> torch.Tensor:
    """a I + b gram for gram [N, A, A], a new tensor in gram's dtype, computed in fp32 and rounded once: one Triton
    pass on CUDA, torch ops elsewhere."""
    if gram.dim() != 3 or gram.shape[-1] != gram.shape[-2]:
        raise ValueError(f"ns_polynomial: need square blocks [N, A, A], got shape {tuple(gram.shape)}")
    if fused_applies([gram]) and gram.is_contiguous() and gram.dtype in (torch.float32, torch.bfloat16):
        from ._muon_triton import ns_poly

        return ns_poly(gram, a, b)
    poly = gram.float() * b
    poly.diagonal(dim1=-2, dim2=-1).add_(a)
    return poly.to(gram.dtype)


def _one_dtype(tensors: list[torch.Tensor]) -> bool:
    return len({t.dtype for t in tensors}) == 1 and tensors[0].dtype in (torch.float32, torch.bfloat16, torch.float16)


def _check(a: list, b: list, slots: list, *scalars: list) -> None:
    if not len(a) == len(b) == len(slots) or any(len(x) != len(a) for x in scalars):
        raise ValueError(f"muon_step: lists of different lengths: {len(a)}, {len(b)}, {len(slots)}, "
                         f"{[len(x) for x in scalars]}")
    for x, y, s in zip(a, b, slots):
        if x.dim() != 3 or x.shape != y.shape or x.shape != s.shape or x.stride() != y.stride():
            raise ValueError(f"muon_step: need [N, R, C] views of one layout and a slot of their shape; got "
                             f"{tuple(x.shape)} {x.stride()}, {tuple(y.shape)} {y.stride()}, slot {tuple(s.shape)}")
        if not s.is_contiguous():
            raise ValueError(f"muon_step: a batch slot must be contiguous, got strides {s.stride()}")
