"""KDA-aware prefix cache (SPEC §7): prefix hashes over fine blocks inside coarse physical pages, KDA state
checkpoints at a sparse subset of fine-block boundaries, and a write-back tier in CPU memory.

A sequence's fine block i (``hash_block`` tokens) is named by the chain hash of blocks 0..i and lives in page
(i * hash_block) // page_tokens of the sequence that computed it. A hit needs both halves of the hybrid state at
one boundary b: the MLA latents of tokens [0, b) (every fine block up to b is present) and a KDA checkpoint
taken exactly at b. Checkpoints are taken every ``checkpoint_every`` fine blocks and at the last full block of
every prompt, so a repeated prompt hits at its last 512-token boundary whatever its length.

Write-back: a cached page nobody holds stays on the device until the device needs the room (LRU); then, instead
of being dropped, its bytes move to the host tier (``HostPool``) and its keys follow it. A hit on host pages
copies them back into fresh device pages. Only when the host tier is full too is the oldest entry forgotten.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence
from dataclasses import dataclass

from .pool import HostPool, PagePool

NO_PAGE = -1  # the "page" of a fine block in a model without MLA layers (only the hash matters)


def extend_hashes(hashes: list[bytes], token_ids, hash_block: int, salt: bytes = b"",
                  media: Sequence[tuple[int, int, bytes]] = ()) -> list[bytes]:
    """Append the chain hash of every full fine block of ``token_ids`` not yet in ``hashes`` (in place; returns
    it): h_i = H(h_{i-1} || salt || tokens of block i || media of block i). ``media``: (start, end, digest) of each
    image whose placeholder tokens are token_ids[start:end]; a block holding some of them hashes the image's digest
    and where it starts relative to the block, so the image is part of that block's name and, through the chain, of
    every later one. A step hashes only the blocks it completed."""
    h = hashes[-1] if hashes else b""
    for i in range(len(hashes), len(token_ids) // hash_block):
        lo, hi = i * hash_block, (i + 1) * hash_block
        blk = array("q", token_ids[lo:hi]).tobytes()
        for start, end, digest in media:
            if start < hi and end > lo:
                blk += array("q", (start - lo, end - start)).tobytes() + digest
        h = hashlib.blake2b(h + salt + blk, digest_size=16).digest()
        hashes.append(h)
    return hashes


def chain_hashes(token_ids, hash_block: int) -> list[bytes]:
    """One digest per full fine block (``extend_hashes`` from nothing)."""
    return extend_hashes([], list(token_ids), hash_block)


@dataclass
class Loc:
    """Where a cached page lives: on the device (``page``) or in the host tier (``host``)."""

    page: int | None = None
    host: int | None = None


@dataclass
class PrefixHit:
    tokens: int  # reusable prefix length (a fine-block boundary), 0 on a miss
    blocks: list[Loc]  # the location of each fine block in [0, tokens)
    checkpoint: list[Loc]  # the KDA state after ``tokens`` tokens, page by page (empty without KDA layers)


class PrefixCache:
    def __init__(self, pool: PagePool, hash_block: int = 512, checkpoint_every: int = 4, host: HostPool | None = None):
        pt = pool.layout.page_tokens
        if hash_block < 1 or pt % hash_block:
            raise ValueError(f"page_tokens ({pt}) must be a multiple of hash_block ({hash_block})")
        if checkpoint_every < 1:
            raise ValueError(f"checkpoint_every must be >= 1, got {checkpoint_every}")
        self.pool, self.hash_block, self.checkpoint_every, self.host = pool, hash_block, checkpoint_every, host
        self.blocks: dict[bytes, Loc] = {}  # chain hash -> the page holding that fine block
        self.checkpoints: dict[bytes, list[Loc]] = {}  # chain hash -> the KDA state pages after that block
        self.page_keys: dict[int, set[bytes]] = {}  # device page -> the keys that point into it
        self.host_keys: dict[int, set[bytes]] = {}  # host page -> the keys that point into it
        pool.on_evict = self._write_back
        if host is not None:
            host.on_evict = self._forget_host

    def is_checkpoint_boundary(self, tokens: int) -> bool:
        return tokens > 0 and tokens % (self.hash_block * self.checkpoint_every) == 0

    # ---- lookup and materialisation -------------------------------------------------------------------------
    def lookup(self, hashes: list[bytes], limit: int) -> PrefixHit:
        """Longest reusable boundary b <= limit tokens of the sequence whose chain hashes are ``hashes``."""
        n_kda = self.pool.layout.n_kda
        best, locs = 0, []
        for i, h in enumerate(hashes[: limit // self.hash_block]):
            loc = self.blocks.get(h)
            if loc is None:
                break
            locs.append(loc)
            if h in self.checkpoints or not n_kda:  # a model without KDA needs no checkpoint
                best = i + 1
        if best == 0:
            return PrefixHit(0, [], [])
        ck = self.checkpoints.get(hashes[best - 1], []) if n_kda else []
        self.pool.touch([x.page for x in locs[:best] + ck if x.page is not None and x.page != NO_PAGE])
        return PrefixHit(best * self.hash_block, locs[:best], ck)

    def materialize(self, hit: PrefixHit) -> list[int]:
        """The requesting sequence's own page list for tokens [0, hit.tokens): a device page whose fine blocks all
        come from it and are all covered is shared (refcount + 1); any other page (the partial last one, one
        assembled from several sources, or one coming back from the host tier) is a fresh page, so the sequence
        can append to it without touching what others read (copy on write). Pages that came back from the host
        are registered on the device again (they are the prefix's new home)."""
        if not self.pool.layout.n_mla:
            return []
        m = self.pool.layout.page_tokens // self.hash_block
        bpb = self.hash_block * self.pool.layout.mla_bytes_per_token
        data, out = self.pool.data, []
        for j in range(0, len(hit.blocks), m):
            group = hit.blocks[j: j + m]
            pages = {x.page for x in group}
            if len(group) == m and len(pages) == 1 and None not in pages:
                self.pool.incref([group[0].page])
                out.append(group[0].page)
                continue
            (dst,) = self.pool.alloc(1)
            for i, loc in enumerate(group):
                lo, hi = i * bpb, (i + 1) * bpb
                src = data[loc.page] if loc.page is not None else self.host.data[loc.host]
                data[dst, lo:hi].copy_(src[lo:hi], non_blocking=True)
            out.append(dst)
        return out

    def restore_checkpoint(self, hit: PrefixHit, dst: list[int]) -> None:
        """Copy the hit's KDA checkpoint into the sequence's own KDA pages (they are updated in place later)."""
        for loc, page in zip(hit.checkpoint, dst):
            if loc.page is not None:
                self.pool.copy_pages([loc.page], [page])
            else:
                self.host.load(loc.host, self.pool.data, page)

    # ---- insertion -------------------------------------------------------------------------------------------
    def insert_blocks(self, hashes: list[bytes], pages: list[int], start_block: int = 0) -> None:
        """Register fine blocks ``start_block..len(hashes)`` of a sequence held in ``pages`` (block i lives in page
        (i * hash_block) // page_tokens). A block already cached (from another sequence) is left as it is."""
        pt, n_mla = self.pool.layout.page_tokens, self.pool.layout.n_mla
        for i in range(start_block, len(hashes)):
            h = hashes[i]
            loc = self.blocks.get(h)
            if loc is not None and loc.page is not None:
                continue
            if loc is not None:  # it was in the host tier: the device holds it again, in this sequence's page
                self._unlink_host(h, loc.host)
            if not n_mla:
                self.blocks[h] = Loc(page=NO_PAGE)
                continue
            page = pages[(i * self.hash_block) // pt]
            self.blocks[h] = Loc(page=page)
            self.page_keys.setdefault(page, set()).add(h)
            self.pool.mark_cached([page])

    def insert_checkpoint(self, h: bytes, kda_pages: list[int]) -> bool:
        """Keep ``kda_pages`` (already written; the caller's reference is dropped after) as the KDA state after the
        block whose chain hash is ``h``. Returns False if one is already cached there."""
        if h in self.checkpoints:
            return False
        self.checkpoints[h] = [Loc(page=p) for p in kda_pages]
        for p in kda_pages:
            self.page_keys.setdefault(p, set()).add(h)
        self.pool.mark_cached(kda_pages)
        return True

    # ---- eviction --------------------------------------------------------------------------------------------
    def _write_back(self, page: int) -> None:
        """The device is reusing ``page``: its keys move to the host tier (or are forgotten without one)."""
        keys = self.page_keys.pop(page, set())
        hp = self.host.store(self.pool.data, page) if self.host is not None and keys else None
        for h in keys:
            loc = self.blocks.get(h)
            if loc is not None and loc.page == page:
                if hp is None:
                    del self.blocks[h]
                else:
                    self.blocks[h] = Loc(host=hp)
                    self.host_keys.setdefault(hp, set()).add(h)
            ck = self.checkpoints.get(h)
            if ck is not None:
                self._checkpoint_page_evicted(h, ck, page, hp)
        if hp is not None and not self.host_keys.get(hp):
            self.host.release(hp)

    def _checkpoint_page_evicted(self, h: bytes, ck: list[Loc], page: int, hp: int | None) -> None:
        if hp is None:  # no host tier: a checkpoint is useless without all of its pages
            del self.checkpoints[h]
            others = [x.page for x in ck if x.page is not None and x.page != page]
            for p in others:
                self.page_keys.get(p, set()).discard(h)
            self.pool.uncache(others)
            return
        for x in ck:
            if x.page == page:
                x.page, x.host = None, hp
                self.host_keys.setdefault(hp, set()).add(h)

    def _unlink_host(self, h: bytes, hp: int) -> None:
        keys = self.host_keys.get(hp, set())
        keys.discard(h)
        if not keys:
            self.host_keys.pop(hp, None)
            self.host.release(hp)

    def _forget_host(self, hp: int) -> None:
        """The host tier is reusing ``hp``: forget every key stored there (a checkpoint as a whole)."""
        for h in self.host_keys.pop(hp, set()):
            loc = self.blocks.get(h)
            if loc is not None and loc.host == hp:
                del self.blocks[h]
            ck = self.checkpoints.pop(h, None)
            if ck is not None:
                for x in ck:
                    if x.page is not None:
                        self.page_keys.get(x.page, set()).discard(h)
                        self.pool.uncache([x.page])
                    elif x.host != hp:
                        self._unlink_host(h, x.host)

    def reusable_blocks(self) -> dict[bytes, bool]:
        """Every cached fine block's chain hash -> whether a hit may end after it (a KDA checkpoint is kept there, or
        the model has no KDA layers): the state a fleet router mirrors (k3.router), since a hybrid prefix is only
        reusable where both the MLA pages and a KDA checkpoint exist."""
        kda = self.pool.layout.n_kda
        return {h: not kda or h in self.checkpoints for h in self.blocks}

    @property
    def num_checkpoints(self) -> int:
        return len(self.checkpoints)

    @property
    def host_pages_in_use(self) -> int:
        return self.host.pages_in_use if self.host is not None else 0
