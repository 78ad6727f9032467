"""Bidirectional attention within each image of a packed patch sequence (SPEC §10: native resolution, several images
of different sizes in one sequence, no attention across images).

Legend: T packed patches, H heads, D head dim, N images, L an image's (or a length group's padded) patches, C the
query rows of one piece.

- ``attend_images_reference``: softmax(q k^T / sqrt(D)) v written out, image by image. It holds each image's
  [H, L, L] scores: the reference, for tests at test sizes only.
- ``attend_images``: on CUDA in bf16/fp16, ONE flash-attention varlen call over all images
  (``torch.nn.attention.varlen.varlen_attn``, full window). Elsewhere the images in length groups
  (``k3.ops.varlen.length_groups``: images of similar size run as one right-padded batch with the padded keys
  masked out, so one large image does not pad many small ones), each group's queries in chunks of C rows
  (``attend_rows``) with C x n x H x L <= ``max_scores``: the scores of one chunk are all that any path holds, so
  memory stays bounded whichever kernel SDPA picks. SDPA always gets 4-D [n, H, L, D] tensors: on CPU that selects
  its flash kernel (O(L) memory); a 3-D call falls back to the math path and materialises [H, L, L] (a
  16384-patch image, 4 heads: 4.3 GB of scores and 10 GB RSS, where the 4-D call peaks at +20 MB).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..ops.varlen import cached_plan, grouped_documents

__all__ = ["attend_images", "attend_images_reference", "attend_rows", "varlen_available", "MAX_SCORES"]

MAX_SCORES = 1 << 25  # attention scores one chunk may hold (32M: 128 MB in fp32), whatever SDPA's kernel


def attend_images_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor
                            ) -> torch.Tensor:
    """q, k, v [T,H,D] packed images (``cu_seqlens`` [N+1]) -> o [T,H,D]: each patch attends to every patch of
    its own image and none of another's."""
    out = []
    bounds = cu_seqlens.tolist()
    for a, b in zip(bounds, bounds[1:]):
        qi, ki, vi = (x[a:b].transpose(0, 1) for x in (q, k, v))  # [H,L,D]
        p = torch.softmax((qi @ ki.transpose(1, 2)) / math.sqrt(q.shape[-1]), dim=-1)  # [H,L,L]
        out.append((p @ vi).transpose(0, 1))
    return torch.cat(out)


def attend_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None,
                max_scores: int = MAX_SCORES) -> torch.Tensor:
    """q [n,H,Lq,D] against k, v [n,H,L,D] (``mask`` [n,1,1,L]: the keys that take weight) -> [n,H,Lq,D], the
    queries in chunks of at most ``max_scores`` scores each."""
    n, H, Lq, _ = q.shape
    rows = max(1, max_scores // max(1, n * H * k.shape[2]))
    if rows >= Lq:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    return torch.cat([F.scaled_dot_product_attention(q[:, :, a: a + rows], k, v, attn_mask=mask)
                      for a in range(0, Lq, rows)], dim=2)


def varlen_available(q: torch.Tensor) -> bool:
    """One flash varlen call can run these: CUDA, bf16/fp16, a head dim flash supports, a torch that has it."""
    if not (q.is_cuda and q.dtype in (torch.bfloat16, torch.float16) and q.shape[-1] <= 256 and q.shape[-1] % 8 == 0):
        return False
    try:
        from torch.nn.attention.varlen import varlen_attn  # noqa: F401
    except ImportError:
        return False
    return True


def attend_images(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                  max_scores: int = MAX_SCORES) -> torch.Tensor:
    """``attend_images_reference``'s result without its [H, L, L] scores: one flash varlen call where it can run
    (``varlen_available``), else length groups with chunked queries (module docstring)."""
    if varlen_available(q):
        from torch.nn.attention.varlen import varlen_attn

        cu, longest = cached_plan(cu_seqlens, ("longest",), lambda cu: (cu, max(b - a for a, b in zip(cu, cu[1:]))))
        cu32 = cu_seqlens.to(q.device, torch.int32)
        return varlen_attn(q, k, v, cu32, cu32, longest, longest, window_size=(-1, -1))
    cu, plan = cached_plan(cu_seqlens, ("images", q.device),
                           lambda cu: (cu, grouped_documents(cu, power=2, device=q.device)))
    if len(cu) == 2:  # one image: no gather, no mask
        q4, k4, v4 = (x.transpose(0, 1)[None] for x in (q, k, v))  # [1,H,L,D]
        return attend_rows(q4, k4, v4, max_scores=max_scores)[0].transpose(0, 1)
    outs = []
    for grp in plan.groups:
        qg, kg, vg = (grp.pad(x).transpose(1, 2) for x in (q, k, v))  # [n,H,L,D]
        mask = grp.valid[:, None, None, :]  # padded keys take no weight; padded queries are dropped after
        outs.append(attend_rows(qg, kg, vg, mask, max_scores).transpose(1, 2))  # [n,L,H,D]
    return plan.scatter(outs)
