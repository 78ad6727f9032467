"""Packed documents <-> padded batch: how the ops run varlen inputs without a varlen kernel.

Legend: T packed tokens, N documents, Tpad the padded length (the longest document, rounded up).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = ["pack_sequences", "unpack_sequences", "document_ids", "same_document", "length_groups",
           "group_rows", "packed_order", "GroupedDocuments", "grouped_documents", "GROUP_OVERHEAD"]

# a padded group's fixed cost in token^2 (gather, attention call, scatter), against count x longest^2 for its work
GROUP_OVERHEAD = 512 ** 2


def pack_sequences(x: torch.Tensor, cu_seqlens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[1, T, ...] packed documents -> ([N, Tpad, ...] zero right-padded, valid mask [N, Tpad]); Tpad is the
    longest document (at least 1)."""
    cu = cu_seqlens.tolist()
    lens = [b - a for a, b in zip(cu, cu[1:])]
    idx, valid = group_rows(cu[:-1], lens, range(len(lens)), max([1, *lens]), x.device)
    out = x[0][idx]  # [N, Tpad, ...]
    mask = valid.view(*valid.shape, *([1] * (out.dim() - 2)))
    return out * mask.to(out.dtype), valid


def unpack_sequences(x: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Inverse of pack_sequences: [N, Tpad, ...] -> [1, T, ...]."""
    return x[valid].unsqueeze(0)



def document_ids(cu_seqlens: torch.Tensor | None, T: int, device) -> torch.Tensor:
    """[T] the document index of every packed position (all zeros without cu_seqlens)."""
    doc = torch.zeros(T + 1, dtype=torch.long, device=device)  # slot T takes boundaries at or past the end
    if cu_seqlens is not None:
        inner = cu_seqlens[1:-1].to(device).clamp(max=T)  # no boolean mask: it would wait for the GPU
        doc.index_add_(0, inner, torch.ones_like(inner))
    return doc[:T].cumsum(0)


def same_document(T: int, shift: int, cu_seqlens: torch.Tensor | None, device) -> torch.Tensor:
    """[T] bool: position t + shift exists and lies in t's document."""
    pos = torch.arange(T, device=device)
    ok = pos + shift < T
    if cu_seqlens is not None:
        doc = document_ids(cu_seqlens, T, device)
        ok = ok & (doc[(pos + shift).clamp(max=T - 1)] == doc)
    return ok


def length_groups(lengths: Sequence[int], overhead: float = GROUP_OVERHEAD, power: int = 2) -> list[list[int]]:
    """Documents of ``lengths`` -> groups to run as one padded batch each, longest first: the partition of the
    lengths sorted longest first into runs that minimises the sum over groups of (documents x longest^power +
    ``overhead``), by dynamic programming. ``power``: 2 for causal attention, 1 for a recurrence. One group is
    the plain padded batch; with ``overhead=0`` every distinct length gets its own. Returns each group's
    document indices (documents of length 0 are in none)."""
    return [list(g) for g in _length_groups(tuple(int(n) for n in lengths), float(overhead), int(power))]


@functools.lru_cache(maxsize=16)  # every layer of a forward asks for the same lengths
def _length_groups(lengths: tuple[int, ...], overhead: float, power: int) -> tuple[tuple[int, ...], ...]:
    if any(n < 0 for n in lengths):
        raise ValueError(f"document lengths must be >= 0; got {list(lengths)}")
    order = sorted((i for i, n in enumerate(lengths) if n), key=lambda i: -lengths[i])
    N = len(order)
    if N == 0:
        return ()
    if overhead == float("inf"):  # the plain padded batch
        return (tuple(order),)
    sq = torch.tensor([float(lengths[i]) ** power for i in order], dtype=torch.float64)  # longest first
    idx = torch.arange(N, dtype=torch.float64)
    best = torch.zeros(N + 1, dtype=torch.float64)  # best[j]: the first j documents grouped
    cut = [0] * (N + 1)
    for j in range(1, N + 1):  # the last group is order[i:j], padded to order[i]'s length
        cand = best[:j] + (j - idx[:j]) * sq[:j]
        i = int(cand.argmin())
        best[j], cut[j] = cand[i] + overhead, i
    groups, j = [], N
    while j:
        groups.append(tuple(order[cut[j]:j]))
        j = cut[j]
    return tuple(reversed(groups))


def group_rows(starts: Sequence[int], lens: Sequence[int], group: Sequence[int], length: int, device):
    """The packed positions of a group's documents as right-padded rows: (idx [n,length], valid [n,length]);
    padding points at position 0 (mask it with ``valid``)."""
    st = torch.tensor([starts[d] for d in group], device=device)
    ln = torch.tensor([lens[d] for d in group], device=device)
    pos = torch.arange(length, device=device)
    valid = pos[None, :] < ln[:, None]
    return torch.where(valid, st[:, None] + pos[None, :], 0), valid


def packed_order(parts: Sequence[torch.Tensor], where: Sequence[torch.Tensor], T: int, dim: int = 0) -> torch.Tensor:
    """Rows computed group by group (``parts``, concatenated along ``dim``; ``where``: their packed positions,
    covering 0..T-1 once) -> the same rows in packed order."""
    order = torch.cat(list(where))
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(T, device=order.device)
    return torch.cat(list(parts), dim=dim).index_select(dim, inverse)


@dataclass(frozen=True)
class GroupedDocuments:
    """Packed documents as padded groups, every index the ops need already on the device (no host reads later).

    ``groups``: per group (idx [n,L] the packed position of every row slot, 0 at padding; valid [n,L] bool;
    take [count] the flat slot index (row * L + t) of the group's real tokens, row by row). ``inverse`` [T]:
    where each packed position sits in the groups' real tokens concatenated in that order.
    """

    groups: tuple[tuple[torch.Tensor, torch.Tensor, torch.Tensor], ...]
    inverse: torch.Tensor

    def gather(self, x: torch.Tensor, group: int, dim: int = 0) -> torch.Tensor:
        """x's packed positions (along ``dim``) as the group's padded rows: [..., n, L, ...] in place of T."""
        idx = self.groups[group][0]
        return x.index_select(dim, idx.flatten()).unflatten(dim, idx.shape)

    def scatter(self, parts: Sequence[torch.Tensor], dim: int = 0) -> torch.Tensor:
        """Per-group outputs with the rows' axes (n, L) flattened at ``dim`` -> packed order: only the real tokens
        are kept, then every position goes back to its place."""
        real = [p.index_select(dim, take) for p, (_, _, take) in zip(parts, self.groups)]
        return torch.cat(real, dim=dim).index_select(dim, self.inverse)


def grouped_documents(cu: Sequence[int], overhead: float = GROUP_OVERHEAD, power: int = 2,
                      device=None) -> GroupedDocuments:
    """``cu``: the cu_seqlens as host integers. Groups of ``length_groups``; the indices are built on the host and
    reach ``device`` in one copy (pinned, non-blocking on CUDA), so running the groups never waits on the GPU."""
    starts, lens = list(cu[:-1]), [b - a for a, b in zip(cu, cu[1:])]
    T = cu[-1] - cu[0]
    host, shapes, order = [], [], []
    for group in length_groups(lens, overhead, power):
        idx, valid = group_rows(starts, lens, group, lens[group[0]], "cpu")
        take = valid.flatten().nonzero().squeeze(1)
        order.append(idx.flatten()[take])
        host += [idx.flatten(), valid.flatten().long(), take]
        shapes.append(tuple(idx.shape))
    inverse = torch.empty(T, dtype=torch.long)
    if order:
        inverse[torch.cat(order) - cu[0]] = torch.arange(T)
    flat = torch.cat([*host, inverse]) if host else inverse
    device = torch.device(device or "cpu")
    if device.type == "cuda":
        flat = flat.pin_memory().to(device, non_blocking=True)
    else:
        flat = flat.to(device)
    parts = flat.split([h.numel() for h in host] + [T])
    groups = tuple((parts[3 * i].view(shape), parts[3 * i + 1].view(shape).bool(), parts[3 * i + 2])
                   for i, shape in enumerate(shapes))
    return GroupedDocuments(groups, parts[-1])
