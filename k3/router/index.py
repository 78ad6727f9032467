"""The router's mirror of each replica's KDA-aware prefix cache (SPEC §7): which fine blocks it holds and after which
of them a KDA checkpoint exists.

A replica publishes ``{chain hash: hit may end here}`` (k3.serve.fleet); the router computes the same chain hashes of
the tokenised prompt (``k3.inference.prefix.extend_hashes``, the engine's own function) and walks them as
``PrefixCache.lookup`` does: the reusable prefix is the longest boundary b where every block before b is held AND a
KDA checkpoint exists at b. A block held without a checkpoint at its end adds nothing on its own: recomputing from the
last checkpoint is what the replica would do.

Between two publications the router also remembers what it sent where (``expect``): a prompt it routed to a replica
is cached there by the time the next turn comes (the engine snapshots the KDA state at each prompt's last full block),
though the replica's next publication may not say so yet. Expectations expire after ``EXPECT_S`` seconds unless the
replica confirms them.
"""

from __future__ import annotations

import time

from ..inference.prefix import extend_hashes

EXPECT_S = 30.0

__all__ = ["PrefixIndex", "prompt_hashes", "EXPECT_S"]


def prompt_hashes(ids: list[int], media: list, hash_block: int) -> list[bytes]:
    """The chain hashes the replica's engine computes for this prompt (``media``: [start, end, digest hex])."""
    if hash_block < 1:
        return []
    return extend_hashes([], list(ids), hash_block, media=[(s, e, bytes.fromhex(d)) for s, e, d in media])


class PrefixIndex:
    """One replica's published blocks (``blocks``: hash -> checkpoint there) plus the router's expectations."""

    def __init__(self):
        self.epoch, self.version, self.hash_block = None, None, 0
        self.blocks: dict[bytes, bool] = {}
        self.expected: dict[bytes, tuple[bool, float]] = {}  # hash -> (checkpoint there, expiry time)

    def apply(self, msg: dict) -> None:
        """Take one answer of the replica's ``GET /v1/prefix_cache`` (a delta or the whole state)."""
        self.hash_block = msg["hash_block"]
        if msg["full"] or msg["epoch"] != self.epoch:
            self.blocks = {bytes.fromhex(h): c for h, c in msg.get("blocks", {}).items()}
        else:
            for h in msg["removed"]:
                self.blocks.pop(bytes.fromhex(h), None)
            self.blocks.update({bytes.fromhex(h): c for h, c in msg["added"].items()})
        self.epoch, self.version = msg["epoch"], msg["version"]

    def reset(self) -> None:
        self.__init__()

    def expect(self, hashes: list[bytes], now: float | None = None) -> None:
        """The prompt of ``hashes`` was sent here: its blocks will be held, with a checkpoint at the last one."""
        if not hashes:
            return
        until = (time.monotonic() if now is None else now) + EXPECT_S
        for h in hashes[:-1]:
            old = self.expected.get(h)
            self.expected[h] = (bool(old and old[0]), until)
        self.expected[hashes[-1]] = (True, until)

    def reusable(self, hashes: list[bytes], now: float | None = None) -> int:
        """Blocks of the longest prefix of ``hashes`` this replica can reuse (times hash_block: tokens)."""
        now = time.monotonic() if now is None else now
        best = 0
        for i, h in enumerate(hashes):
            ck = self.blocks.get(h)
            if ck is None:
                exp = self.expected.get(h)
                if exp is None or exp[1] < now:
                    break
                ck = exp[0]
            elif not ck:
                exp = self.expected.get(h)
                ck = bool(exp and exp[0] and exp[1] >= now)
            if ck:
                best = i + 1
        return best

    def expire(self, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        self.expected = {h: v for h, v in self.expected.items() if v[1] >= now and h not in self.blocks}
