"""Packed documents <-> padded batch: how the ops run varlen inputs without a varlen kernel.

Legend: T packed tokens, N documents, Tpad the padded length (the longest document, rounded up).
"""

from __future__ import annotations

import torch

__all__ = ["pack_sequences", "unpack_sequences", "document_ids", "same_document"]


def pack_sequences(x: torch.Tensor, cu_seqlens: torch.Tensor, multiple: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """[1, T, ...] packed documents -> ([N, Tpad, ...] zero right-padded, valid mask [N, Tpad])."""
    lens = cu_seqlens[1:] - cu_seqlens[:-1]
    tmax = int(lens.max()) if lens.numel() else 0
    tpad = max(multiple, -(-tmax // multiple) * multiple)
    pos = torch.arange(tpad, device=x.device)
    valid = pos[None, :] < lens[:, None].to(x.device)  # [N, Tpad]
    idx = torch.where(valid, cu_seqlens[:-1, None].to(x.device) + pos[None, :], 0)
    out = x[0][idx]  # [N, Tpad, ...]
    mask = valid.view(*valid.shape, *([1] * (out.dim() - 2)))
    return out * mask.to(out.dtype), valid


def unpack_sequences(x: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Inverse of pack_sequences: [N, Tpad, ...] -> [1, T, ...]."""
    return x[valid].unsqueeze(0)



def document_ids(cu_seqlens: torch.Tensor | None, T: int, device) -> torch.Tensor:
    """[T] the document index of every packed position (all zeros without cu_seqlens)."""
    doc = torch.zeros(T, dtype=torch.long, device=device)
    if cu_seqlens is not None:
        inner = cu_seqlens[1:-1].to(device)
        inner = inner[inner < T]
        doc.index_add_(0, inner, torch.ones_like(inner))
    return doc.cumsum(0)


def same_document(T: int, shift: int, cu_seqlens: torch.Tensor | None, device) -> torch.Tensor:
    """[T] bool: position t + shift exists and lies in t's document."""
    pos = torch.arange(T, device=device)
    ok = pos + shift < T
    if cu_seqlens is not None:
        doc = document_ids(cu_seqlens, T, device)
        ok = ok & (doc[(pos + shift).clamp(max=T - 1)] == doc)
    return ok
