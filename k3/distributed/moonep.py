"""MoonEP planner: perfectly balanced expert parallelism with dynamic replicas (SPEC §8, Theorems 1 and 2).

Problem. E experts over R ranks; rank r owns the m = E/R experts [r*m, (r+1)*m). One step routes load[e] tokens
to expert e, and every rank must compute exactly T = sum(load) / R (= S*K) tokens. A plan lists, per rank, the
(expert, tokens) pairs it computes; a pair for an expert the rank does not own is a replica (the rank holds a copy
of that expert's weights for the step). A valid plan balances exactly, covers every expert's load exactly, gives
each rank at most m replicas (Theorem 1: m redundant slots always suffice), and lets a rank whose own load
L_r <= T compute all of its own tokens.

Why the obvious design fails. Pouring the overloaded ranks' overflow into the underloaded ranks' free room (a
two-pointer merge) bounds the TOTAL number of new pieces, not the pieces per rank. Take rank 0 idle and every
other rank T/(R-1) over: each overloaded rank must ship something of its own to rank 0, so rank 0 hosts R-1
replicas, more than m once R-1 > m (R=128, E=896: 127 vs 7). Work has to be passed along a chain instead.

Algorithm: Walker/Vose's alias-table construction, run on ranks. A rank holding fewer than T of its own tokens is
small, more than T large. Pair the small rank s with the largest deficit d = T - held[s] with the large rank l with
the largest excess: s takes d tokens of l's own experts, poured from l's queue in descending expert load (few,
big pieces), and s is final. l keeps the rest: below T it turns small (it will take from one later donor), at T
it is final, above T it stays large.

Proof sketch of the bound. The unfinished ranks hold exactly T tokens each on average (every pairing removes one
rank holding T), so a large rank exists while a small one does, and it holds more than T >= d: pairing never
fails and ends after at most R-1 rounds. A rank receives only once, from one donor, at the moment it is finished,
and a donor gives only its own experts, at most m distinct ones. Hence every rank holds at most m replicas
(Theorem 1) and at most 2m (expert, tokens) entries (the static dispatch shape); a rank with L_r <= T is never
large, so it never gives anything away. Cost: O(E log E) to sort the queues, O(R log R) for the heaps, O(E + R) pouring.
Tightness (Theorem 2): with rank 0 idle and every other expert carrying c tokens, rank 0 must gather
T = (R-1) m c / R tokens in pieces of at most c, i.e. at least ceil(E (R-1) / R^2) replicas under any planner.

Legend: E experts, R ranks, m = E/R experts per rank, T = S*K tokens per rank, M = 2m planned entries per rank.
"""

from __future__ import annotations

import heapq
import operator
from typing import NamedTuple, Sequence

import torch

__all__ = ["plan", "validate", "plan_arrays", "PlanArrays"]

Plan = list[list[tuple[int, int]]]


class PlanArrays(NamedTuple):
    """Static-shape plan for an all-to-all dispatch, rows = ranks, padding = expert -1 with 0 tokens.

    experts[r, j] computes counts[r, j] tokens of that expert on rank r: the tokens [offsets[r, j],
    offsets[r, j] + counts[r, j]) of the expert, its tokens ordered by source (rank, position). Entries of one
    expert follow rank order, so its offsets are increasing and tile [0, load)."""

    experts: torch.Tensor  # [R,M] int64
    counts: torch.Tensor  # [R,M] int64
    offsets: torch.Tensor  # [R,M] int64


def plan(expert_loads: Sequence[int] | torch.Tensor, num_ranks: int) -> Plan:
    """Per rank, the (expert, tokens) pairs it computes, sorted by expert: exactly sum/R tokens per rank, at most
    E/R replicas per rank, zero-load experts absent. Raises ValueError on invalid loads."""
    loads = _check_loads(expert_loads, num_ranks)
    R, m, T = num_ranks, len(loads) // num_ranks, sum(loads) // num_ranks
    queues = [_own_queue(loads, r, m) for r in range(R)]  # own (expert, tokens), ascending: biggest at the end
    held = [sum(t for _, t in q) for q in queues]
    received: list[list[tuple[int, int]]] = [[] for _ in range(R)]
    small = [(h - T, r) for r, h in enumerate(held) if h < T]  # min-heap: largest deficit first
    large = [(T - h, r) for r, h in enumerate(held) if h > T]  # min-heap: largest excess first
    heapq.heapify(small)
    heapq.heapify(large)
    while small:
        _, s = heapq.heappop(small)
        _, l = heapq.heappop(large)  # exists: the unfinished ranks average exactly T
        d = T - held[s]
        received[s] = _pour(queues[l], d)
        held[s], held[l] = T, held[l] - d
        if held[l] < T:
            heapq.heappush(small, (held[l] - T, l))
        elif held[l] > T:
            heapq.heappush(large, (T - held[l], l))
    return [sorted(queues[r] + received[r]) for r in range(R)]


def plan_arrays(expert_loads: Sequence[int] | torch.Tensor, num_ranks: int) -> PlanArrays:
    """plan() packed into [R, 2E/R] int64 tensors (see PlanArrays)."""
    loads = _check_loads(expert_loads, num_ranks)
    R, M = num_ranks, 2 * len(loads) // num_ranks
    rows = plan(loads, num_ranks)
    experts, counts, offsets = [[-1] * M for _ in range(R)], [[0] * M for _ in range(R)], [[0] * M for _ in range(R)]
    start = [0] * len(loads)  # next uncovered token of each expert, walking ranks in order
    for r, row in enumerate(rows):
        for j, (e, t) in enumerate(row):
            experts[r][j], counts[r][j], offsets[r][j] = e, t, start[e]
            start[e] += t
    as_tensor = lambda x: torch.tensor(x, dtype=torch.int64, device="cpu").reshape(R, M)  # noqa: E731
    return PlanArrays(as_tensor(experts), as_tensor(counts), as_tensor(offsets))


def validate(plan: Plan, expert_loads: Sequence[int] | torch.Tensor, num_ranks: int) -> None:
    """Raise ValueError naming the first violated MoonEP property of `plan` for these loads; return None if valid."""
    loads = _check_loads(expert_loads, num_ranks)
    E, R = len(loads), num_ranks
    m, T = E // R, sum(loads) // R
    if len(plan) != R:
        raise ValueError(f"plan has {len(plan)} ranks, expected num_ranks={R}")
    covered = [0] * E
    for r, row in enumerate(plan):
        on_rank = dict(_check_row(row, r, E))
        own = range(r * m, (r + 1) * m)
        if sum(on_rank.values()) != T:
            raise ValueError(f"rank {r} computes {sum(on_rank.values())} tokens, expected exactly sum/R = {T}")
        replicas = [e for e in on_rank if e not in own]
        if len(replicas) > m:
            raise ValueError(f"rank {r} hosts {len(replicas)} replica experts {sorted(replicas)}, bound is E/R = {m}")
        if sum(loads[e] for e in own) <= T:
            for e in own:
                if loads[e] and on_rank.get(e) != loads[e]:
                    raise ValueError(f"rank {r} is not overloaded yet computes {on_rank.get(e, 0)} of its own "
                                     f"expert {e}'s {loads[e]} tokens; it must compute all of them locally")
        for e, t in on_rank.items():
            covered[e] += t
    for e, (c, want) in enumerate(zip(covered, loads)):
        if c != want:
            raise ValueError(f"expert {e} has {want} tokens but the plan computes {c} of them")


def _check_loads(expert_loads: Sequence[int] | torch.Tensor, num_ranks: int) -> list[int]:
    if isinstance(expert_loads, torch.Tensor):
        if expert_loads.dim() != 1 or expert_loads.is_floating_point() or expert_loads.is_complex():
            raise ValueError(f"expert_loads must be a 1-D integer tensor of token counts; got {expert_loads.dim()}-D "
                             f"{expert_loads.dtype}")
        loads = expert_loads.tolist()
    else:
        try:
            loads = [operator.index(x) for x in expert_loads]
        except TypeError as err:
            raise ValueError(f"expert_loads must hold integer token counts: {err}") from None
    if isinstance(num_ranks, bool) or not isinstance(num_ranks, int) or num_ranks < 1:
        raise ValueError(f"num_ranks must be a positive int; got {num_ranks!r}")
    E = len(loads)
    if E == 0 or E % num_ranks:
        raise ValueError(f"number of experts E={E} is not a positive multiple of num_ranks={num_ranks}: every rank "
                         f"owns E/R contiguous experts; choose R dividing E")
    negative = [e for e, x in enumerate(loads) if x < 0]
    if negative:
        e = negative[0]
        raise ValueError(f"expert_loads[{e}] = {loads[e]} is negative ({len(negative)} negative in all); loads are "
                         f"token counts")
    if sum(loads) % num_ranks:
        raise ValueError(f"total load {sum(loads)} is not divisible by num_ranks={num_ranks}: each rank computes "
                         f"exactly sum/R = S*K tokens, so route a multiple of R tokens")
    return loads


def _check_row(row: Sequence[tuple[int, int]], r: int, E: int) -> list[tuple[int, int]]:
    seen = set()
    for e, t in row:
        if not 0 <= e < E:
            raise ValueError(f"rank {r} lists expert {e}, outside [0, {E})")
        if t <= 0:
            raise ValueError(f"rank {r} lists expert {e} with {t} tokens; entries must be positive")
        if e in seen:
            raise ValueError(f"rank {r} lists expert {e} twice")
        seen.add(e)
    return list(row)


def _own_queue(loads: list[int], r: int, m: int) -> list[tuple[int, int]]:
    """Rank r's nonzero own experts as (expert, tokens), ascending by tokens so the biggest pours first."""
    return sorted(((e, loads[e]) for e in range(r * m, (r + 1) * m) if loads[e]), key=lambda p: (p[1], -p[0]))


def _pour(queue: list[tuple[int, int]], d: int) -> list[tuple[int, int]]:
    """Take d tokens off the big end of queue (in place): whole experts, then a split of the last one."""
    taken = []
    while d:
        e, t = queue.pop()
        if t > d:
            queue.append((e, t - d))
            t = d
        taken.append((e, t))
        d -= t
    return taken
