"""Where a request goes (SPEC §7 fleet routing): cache-aware affinity over consistent hashing, with load-aware spill.

- ``affinity``: the replica holding the longest reusable prefix of the prompt (``PrefixIndex.reusable``: MLA pages
  AND a KDA checkpoint); with no hit anywhere, the key's primary on the hash ring. The key is the session (header
  ``X-Session-Id``, else the body's ``user``), else the hash of the prompt's first block, so a new session lands where
  its later turns will look. If the chosen replica's load exceeds the lighter of the key's primary and backup by
  ``spill`` (requests; a queued prompt token counts 1/``LOAD_TOKENS`` of one), the request spills to that one.
- ``first-block``: the ring's primary for the prompt's first block (prefix hashing without an index; spills alike).
- ``round-robin`` and ``least-load``: the baselines, blind to caches.

The ring (uhashring, ketama-compatible) holds every configured replica, healthy or not; a key's preference list is
its ring order with unhealthy replicas skipped, so a dead replica's keys move to their backups and only they move,
and come back when it re-enters.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from uhashring import HashRing

POLICIES = ("affinity", "round-robin", "least-load", "first-block")
LOAD_TOKENS = 2048  # queued prompt tokens that weigh as much as one request in flight

__all__ = ["POLICIES", "Choice", "Ring", "choose", "LOAD_TOKENS"]


@dataclass
class Choice:
    replica: object  # k3.router.fleet.Replica
    backup: object | None  # where a failed attempt goes (not the same replica)
    spilled: bool


class Ring:
    def __init__(self, names: list[str]):
        self.ring = HashRing(nodes=list(names))
        self.n = len(names)

    def order(self, key: str) -> list[str]:
        """Every replica, in the key's ring order (primary first)."""
        return [node["nodename"] for node in self.ring.range(key, self.n, True)]


def load(replica) -> float:
    return replica.inflight + replica.queued_tokens / LOAD_TOKENS


class _RoundRobin:
    def __init__(self):
        self.counter = itertools.count()

    def next(self, healthy: list):
        return healthy[next(self.counter) % len(healthy)]


def choose(policy: str, ring: Ring, replicas: dict, key: str | None, hashes: list[bytes], spill: float,
           rr: _RoundRobin) -> Choice:
    """The replica for one request, among ``replicas`` (name -> Replica) that are healthy. Raises LookupError when
    none is."""
    healthy = [r for r in replicas.values() if r.healthy]
    if not healthy:
        raise LookupError("no replica is healthy")
    pref = [replicas[n] for n in ring.order(key) if n in replicas] if key else sorted(healthy, key=load)
    pref = [r for r in pref if r.healthy]
    primary, backup = pref[0], (pref[1] if len(pref) > 1 else None)
    if policy == "round-robin":
        r = rr.next(healthy)
        return Choice(r, _other(healthy, r), False)
    if policy == "least-load":
        r = min(healthy, key=load)
        return Choice(r, _other(healthy, r), False)
    target = primary
    if policy == "affinity" and hashes:
        best = max(pref, key=lambda r: r.index.reusable(hashes))  # ties: ring order (max keeps the first)
        if best.index.reusable(hashes):
            target = best
    lighter = min((r for r in (primary, backup) if r is not None and r is not target), key=load, default=None)
    if lighter is not None and load(target) > load(lighter) + spill:
        return Choice(lighter, target, True)
    return Choice(target, backup if backup is not target else primary, False)


def _other(healthy: list, r):
    rest = [x for x in healthy if x is not r]
    return min(rest, key=load) if rest else None
