"""Fleet-wide admission per request class (SPEC §7): each class of prompt length has its share of the fleet's
capacity, so a burst of 1M-token prompts waits in its own queue while short requests keep their slots.

The fleet's capacity is ``max_inflight`` requests per healthy replica. A class with share s may hold at most
max(1, floor(s * capacity)) requests in flight; the rest of its requests wait in its FIFO queue. Classes never borrow
each other's slots: the point is that the long class cannot take the short class's capacity, even when it arrives
first. A class is named by the shortest prompt it takes: ``short=0:0.75,long=8192:0.25``.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from dataclasses import dataclass, field

__all__ = ["RequestClass", "Admission", "parse_classes"]


@dataclass
class RequestClass:
    name: str
    min_tokens: int
    share: float
    inflight: int = 0
    admitted: int = 0
    queued_total: int = 0  # requests that had to wait
    waiters: deque = field(default_factory=deque)
    waits: deque = field(default_factory=lambda: deque(maxlen=4096))  # seconds each of the last requests waited
    max_queue: int = 0


def parse_classes(text: str) -> list[RequestClass]:
    """``name=min_tokens:share,...`` (the --classes flag) -> classes, shortest first."""
    out = []
    for part in text.split(","):
        try:
            name, rest = part.split("=")
            lo, share = rest.split(":")
            out.append(RequestClass(name.strip(), int(lo), float(share)))
        except ValueError:
            raise ValueError(f"--classes: {part!r} is not name=min_tokens:share (e.g. short=0:0.75,long=8192:0.25)"
                             ) from None
    out.sort(key=lambda c: c.min_tokens)
    if not out or out[0].min_tokens != 0:
        raise ValueError("--classes: one class must start at 0 tokens (e.g. short=0:0.75), so every prompt has one")
    if any(not 0 < c.share <= 1 for c in out) or sum(c.share for c in out) > 1 + 1e-9:
        raise ValueError("--classes: each share must be in (0, 1] and the shares must sum to at most 1")
    if len({c.name for c in out}) != len(out):
        raise ValueError("--classes: class names must differ")
    return out


class Admission:
    def __init__(self, classes: list[RequestClass], max_inflight: int):
        self.classes, self.max_inflight, self.replicas = classes, max_inflight, 1

    def class_of(self, n_tokens: int) -> RequestClass:
        return [c for c in self.classes if n_tokens >= c.min_tokens][-1]

    def budget(self, c: RequestClass) -> int:
        return max(1, int(c.share * self.max_inflight * max(self.replicas, 1)))

    async def acquire(self, c: RequestClass) -> float:
        """Wait for a slot of class ``c``; returns the seconds waited. The caller must ``release(c)`` after."""
        t0 = time.monotonic()
        if c.inflight >= self.budget(c) or c.waiters:
            fut = asyncio.get_running_loop().create_future()
            c.waiters.append(fut)
            c.queued_total += 1
            c.max_queue = max(c.max_queue, len(c.waiters))
            try:
                await fut
            except asyncio.CancelledError:
                if fut in c.waiters:
                    c.waiters.remove(fut)
                elif fut.done() and not fut.cancelled():
                    self.release(c)  # the slot handed to us goes to the next one
                raise
        else:
            c.inflight += 1
        c.admitted += 1
        waited = time.monotonic() - t0
        c.waits.append(waited)
        return waited

    def release(self, c: RequestClass, taken: bool = True) -> None:
        if taken:
            c.inflight -= 1
        self.wake(c)

    def wake(self, c: RequestClass) -> None:
        """Hand free slots to waiters (a slot is counted as taken when handed over)."""
        while c.waiters and c.inflight < self.budget(c):
            fut = c.waiters.popleft()
            if not fut.done():
                c.inflight += 1
                fut.set_result(None)

    def set_replicas(self, n: int) -> None:
        self.replicas = n
        for c in self.classes:
            self.wake(c)

    def stats(self) -> dict:
        out = {}
        for c in self.classes:
            w = sorted(c.waits)
            q = (lambda p: round(w[min(len(w) - 1, int(p * len(w)))], 4) if w else 0.0)
            out[c.name] = {"min_tokens": c.min_tokens, "share": c.share, "budget": self.budget(c),
                           "inflight": c.inflight, "queued": len(c.waiters), "max_queued": c.max_queue,
                           "admitted": c.admitted, "waited": c.queued_total, "wait_p50_s": q(0.5),
                           "wait_p99_s": q(0.99)}
        return out
