"""Packed documents <-> padded batch: how the ops run varlen inputs without a varlen kernel.

Legend: T packed tokens, N documents, Tpad the padded length (the longest document, rounded up).
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = ["pack_sequences", "unpack_sequences", "document_ids", "same_document", "length_groups", "PaddedRows",
           "GroupedDocuments", "padded_documents", "grouped_documents", "cached_plan", "place_cu_seqlens",
           "known_host_values", "register_plans", "plans_of", "document_offsets", "document_starts",
           "check_cu_seqlens", "GROUP_OVERHEAD"]

# a padded group's fixed cost in token^2 (gather, attention call, scatter), against count x longest^2 for its work
GROUP_OVERHEAD = 512 ** 2


def pack_sequences(x: torch.Tensor, cu_seqlens: torch.Tensor) -> tuple[torch.Tensor, PaddedRows]:
    """[1, T, ...] packed documents -> ([N, Tpad, ...] zero right-padded, in document order; the rows' layout, whose
    ``valid`` [N, Tpad] marks the real positions). Tpad is the longest document (at least 1)."""
    rows = cached_plan(cu_seqlens, ("documents", x.device), lambda cu: padded_documents(cu, x.device))
    return rows.pad(x[0]), rows


def unpack_sequences(x: torch.Tensor, rows: PaddedRows) -> torch.Tensor:
    """Inverse of pack_sequences: [N, Tpad, ...] -> [1, T, ...]."""
    return rows.unpad(x)[None]


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


@dataclass(frozen=True)
class PaddedRows:
    """Packed documents as zero right-padded rows [n, L], everything the ops need already on the device.

    ``documents``: the documents' indices, one per row. ``positions`` [count]: the packed position of every real
    token, row by row (None: the packed order itself). ``slots`` [count]: its flat slot, row * L + t. ``valid``
    [n, L]: the real slots. Padding and unpadding move each real token once, by distinct indices: on CUDA,
    gathering every pad slot from one position made the backward accumulate thousands of repeats of one index,
    which index_put serialises.
    """

    documents: tuple[int, ...]
    shape: tuple[int, int]
    positions: torch.Tensor | None
    slots: torch.Tensor
    valid: torch.Tensor

    def pad(self, x: torch.Tensor, dim: int = 0) -> torch.Tensor:
        """x with the packed axis (T) at ``dim`` -> the rows [n, L] there, zeros at the padding."""
        real = x if self.positions is None else x.index_select(dim, self.positions)
        size = list(x.shape)
        size[dim] = self.shape[0] * self.shape[1]
        return x.new_zeros(size).index_copy(dim, self.slots, real).unflatten(dim, self.shape)

    def unpad(self, y: torch.Tensor, dim: int = 0) -> torch.Tensor:
        """Rows [n, L] at ``dim``, ``dim + 1`` -> their real tokens [count] at ``dim``, row by row."""
        return y.flatten(dim, dim + 1).index_select(dim, self.slots)


@dataclass(frozen=True)
class GroupedDocuments:
    """Packed documents in length groups, each a ``PaddedRows``; ``inverse`` [T]: where each packed position sits
    in the groups' real tokens concatenated in group order."""

    groups: tuple[PaddedRows, ...]
    inverse: torch.Tensor

    def scatter(self, parts, dim: int = 0) -> torch.Tensor:
        """Per-group outputs (rows [n, L] at ``dim``) -> the packed axis [T] at ``dim``, in packed order."""
        real = [grp.unpad(p, dim) for grp, p in zip(self.groups, parts)]
        return torch.cat(real, dim=dim).index_select(dim, self.inverse)


def _rows_on_host(starts, lens, docs, L):
    st = torch.tensor([starts[d] for d in docs], dtype=torch.long)
    ln = torch.tensor([lens[d] for d in docs], dtype=torch.long)
    pos = torch.arange(L)
    valid = pos[None, :] < ln[:, None]  # [n, L]
    slots = valid.flatten().nonzero().squeeze(1)
    positions = (st[:, None] + pos[None, :]).flatten()[slots]
    return positions, slots, valid


def _to_device(host: list[torch.Tensor], device) -> list[torch.Tensor]:
    """Host int64 tensors -> the same on ``device``, in one copy (pinned and non-blocking on CUDA)."""
    flat = torch.cat([h.flatten().long() for h in host]) if host else torch.zeros(0, dtype=torch.long)
    device = torch.device(device if device is not None else "cpu")
    flat = flat.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else flat.to(device)
    return [part.view(h.shape) for part, h in zip(flat.split([h.numel() for h in host]), host)]


def padded_documents(cu: Sequence[int], device=None) -> PaddedRows:
    """``cu``: cu_seqlens as host integers -> every document a row, in document order, padded to the longest
    (at least 1); rows of empty documents are all padding."""
    starts, lens = list(cu[:-1]), [b - a for a, b in zip(cu, cu[1:])]
    _, slots, valid = _rows_on_host(starts, lens, range(len(lens)), max([1, *lens]))
    slots, valid = _to_device([slots, valid], device)
    return PaddedRows(tuple(range(len(lens))), tuple(valid.shape), None, slots, valid.bool())


def grouped_documents(cu: Sequence[int], overhead: float = GROUP_OVERHEAD, power: int = 2, device=None,
                      unit: int = 1) -> GroupedDocuments:
    """``cu``: cu_seqlens as host integers -> the ``length_groups`` of the documents' lengths in ``unit``s (a
    group's rows: its longest document, rounded up to whole units); the indices reach ``device`` in one copy,
    so running the groups never waits for the GPU."""
    starts, lens = list(cu[:-1]), [b - a for a, b in zip(cu, cu[1:])]
    units = [-(-n // unit) for n in lens]
    groups, host = length_groups(units, overhead, power), []
    for group in groups:
        host += _rows_on_host(starts, lens, group, units[group[0]] * unit)
    order = torch.cat(host[0::3]) if groups else torch.zeros(0, dtype=torch.long)
    inverse = torch.empty(cu[-1], dtype=torch.long)
    inverse[order] = torch.arange(len(order))
    dev = _to_device(host + [inverse], device)
    rows = tuple(PaddedRows(tuple(group), tuple(dev[3 * i + 2].shape), dev[3 * i], dev[3 * i + 1],
                            dev[3 * i + 2].bool()) for i, group in enumerate(groups))
    return GroupedDocuments(rows, dev[-1])


_PLANS: list = []  # (weakref to a cu_seqlens tensor, its version, key, value), the most recent last
_HOST = "host values"  # the key of a tensor's own values, read once and shared by every plan built from it


def _lookup(cu_seqlens: torch.Tensor, key):
    for ref, version, k, value in reversed(_PLANS):
        if ref() is cu_seqlens and version == cu_seqlens._version and k == key:
            return value
    return None


def _store(cu_seqlens: torch.Tensor, key, value) -> None:
    _PLANS.append((weakref.ref(cu_seqlens), cu_seqlens._version, key, value))
    del _PLANS[:-16]


def cached_plan(cu_seqlens: torch.Tensor, key, build):
    """``build(cu_seqlens.tolist())``, once per (tensor, in-place version, ``key``): every layer of a forward (its
    backward, the recompute of activation checkpointing) gets the same cu_seqlens, and each read of a CUDA tensor
    waits for the GPU. The values themselves are read once per tensor, whatever the keys. Keeps the last 16."""
    plan = _lookup(cu_seqlens, key)
    if plan is None:
        host = _lookup(cu_seqlens, _HOST)
        if host is None:
            host = cu_seqlens.tolist()
            _store(cu_seqlens, _HOST, host)
        plan = build(host)
        _store(cu_seqlens, key, plan)
    return plan


def register_plans(cu_seqlens: torch.Tensor, host, plans: dict) -> None:
    """Give a cu_seqlens tensor its host values (``host``: what builders of other plans receive) and ready-made
    ``plans`` by key, in place of what ``cached_plan`` would build: a CUDA graph's buffers, whose plans are device
    tensors refreshed before each replay (``k3.train.graph``)."""
    _store(cu_seqlens, _HOST, host)
    for key, value in plans.items():
        _store(cu_seqlens, key, value)


def plans_of(cu_seqlens: torch.Tensor) -> list:
    """Every plan ``cached_plan`` holds for this tensor (its host values included): what a CUDA graph that read
    them keeps alive."""
    return [value for ref, version, _, value in _PLANS if ref() is cu_seqlens and version == cu_seqlens._version]


def place_cu_seqlens(cu_seqlens: torch.Tensor, device) -> torch.Tensor:
    """Host cu_seqlens (the loader's) -> the same on ``device``, with its values remembered for ``cached_plan``: the
    layers' plans (and fla's chunk list) then never read it back from the device, which on CUDA waits for every
    queued kernel. The copy itself goes through pinned memory without blocking. (A cu_seqlens already on a device
    is read once here.)"""
    host = cu_seqlens.tolist()
    placed = _to_device([cu_seqlens.cpu()], device)[0].to(cu_seqlens.dtype)
    _store(placed, _HOST, host)
    return placed


def known_host_values(cu_seqlens: torch.Tensor) -> list[int] | None:
    """The host values of a cu_seqlens tensor if they are known without reading the device, else None."""
    return _lookup(cu_seqlens, _HOST)


def check_cu_seqlens(cu: Sequence[int], tokens: int | None = None, who: str = "") -> None:
    """Refuse host cu_seqlens that do not rise from 0 (to ``tokens`` when given), naming them; ``who`` prefixes the
    message."""
    if len(cu) < 2 or cu[0] != 0 or (tokens is not None and cu[-1] != tokens) or any(b < a for a, b in zip(cu, cu[1:])):
        to = f"the {tokens}" if tokens is not None else "the number of"
        shown = f"{list(cu[:8])}..." if len(cu) > 8 else f"{list(cu)}"
        raise ValueError(f"{who}cu_seqlens must rise from 0 to {to} packed tokens; got {shown}")


def document_starts(cu_seqlens: torch.Tensor, device) -> torch.Tensor:
    """[T] int64 on ``device``: the first position of each packed position's document, built once per cu_seqlens
    tensor (``cached_plan``; a CUDA graph registers its own buffer under this key). Read by QK-clip's max-logit
    kernel and the short convolution's."""
    def build(cu):
        check_cu_seqlens(cu)
        offsets, _, _ = document_offsets(cu, device)
        return torch.arange(cu[-1] - cu[0], device=device) - offsets
    return cached_plan(cu_seqlens, ("starts", torch.device(device)), build)


def document_offsets(cu: Sequence[int], device=None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``cu``: cu_seqlens as host integers -> (offset of every token in its document [T], starts [N], lengths [N]),
    int64 on ``device`` in one copy."""
    starts = torch.tensor(cu[:-1], dtype=torch.long)
    lens = torch.tensor(cu[1:], dtype=torch.long) - starts
    rel = torch.arange(cu[-1] - cu[0]) - torch.repeat_interleave(starts - cu[0], lens)
    return tuple(_to_device([rel, starts, lens], device))
