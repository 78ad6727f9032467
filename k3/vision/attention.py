"""Bidirectional attention within each image of a packed patch sequence (SPEC §10: native resolution, several images
of different sizes in one sequence, no attention across images).

Legend: T packed patches, H heads, D head dim, N images.

- ``attend_images_reference``: the images in length groups (``k3.ops.varlen.length_groups``: images of similar size
  run as one right-padded batch, so one large image does not pad many small ones), one SDPA call per group with the
  padded keys masked out. Pure torch; CPU and GPU; the reference.
- ``attend_images``: on CUDA in bf16/fp16, ONE flash-attention varlen call over all images
  (``torch.nn.attention.varlen.varlen_attn``, full window); elsewhere the reference.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..ops.varlen import cached_plan, grouped_documents

__all__ = ["attend_images", "attend_images_reference", "varlen_available"]


def attend_images_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor
                            ) -> torch.Tensor:
    """q, k, v [T,H,D] packed images (``cu_seqlens`` [N+1]) -> o [T,H,D]: each patch attends to every patch of
    its own image and none of another's."""
    cu, plan = cached_plan(cu_seqlens, ("images", q.device),
                           lambda cu: (cu, grouped_documents(cu, power=2, device=q.device)))
    if len(cu) == 2:  # one image: no gather
        return F.scaled_dot_product_attention(*(x.transpose(0, 1) for x in (q, k, v))).transpose(0, 1)
    outs = []
    for grp in plan.groups:
        qg, kg, vg = (grp.pad(x).transpose(1, 2) for x in (q, k, v))  # [n,H,L,D]
        mask = grp.valid[:, None, None, :]  # padded keys take no weight; padded queries are dropped after
        outs.append(F.scaled_dot_product_attention(qg, kg, vg, attn_mask=mask).transpose(1, 2))  # [n,L,H,D]
    return plan.scatter(outs)


def varlen_available(q: torch.Tensor) -> bool:
    """One flash varlen call can run these: CUDA, bf16/fp16, a head dim flash supports, a torch that has it."""
    if not (q.is_cuda and q.dtype in (torch.bfloat16, torch.float16) and q.shape[-1] <= 256 and q.shape[-1] % 8 == 0):
        return False
    try:
        from torch.nn.attention.varlen import varlen_attn  # noqa: F401
    except ImportError:
        return False
    return True


def attend_images(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """``attend_images_reference``'s result, in one flash varlen call where it can run (``varlen_available``)."""
    if not varlen_available(q):
        return attend_images_reference(q, k, v, cu_seqlens)
    from torch.nn.attention.varlen import varlen_attn

    cu, longest = cached_plan(cu_seqlens, ("longest",), lambda cu: (cu, max(b - a for a, b in zip(cu, cu[1:]))))
    cu32 = cu_seqlens.to(q.device, torch.int32)
    return varlen_attn(q, k, v, cu32, cu32, longest, longest, window_size=(-1, -1))
