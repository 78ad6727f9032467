"""KDA-aware prefix cache (SPEC §7): prefix hashes over fine blocks inside coarse physical pages, and KDA state
checkpoints at a sparse subset of fine-block boundaries.

A prompt's fine block i (``hash_block`` tokens) is named by the chain hash of blocks 0..i, and lives in page
(i * hash_block) // page_tokens of the request that computed it. A hit needs both halves of the hybrid state at
one boundary b: the MLA latents of tokens [0, b) (every fine block up to b is present) and a KDA checkpoint
taken exactly at b. Checkpoints are kept every ``checkpoint_every`` fine blocks, so a lookup returns the
longest such boundary.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from .pool import BlockPool

NO_PAGE = -1  # the "page" of a fine block in a model without MLA layers


@dataclass
class PrefixHit:
    tokens: int  # reusable prefix length (a fine-block boundary), 0 on a miss
    block_pages: list[int]  # the physical page of each fine block in [0, tokens)
    kda_pages: list[int] | None  # the checkpoint's pages (state after ``tokens`` tokens)


def chain_hashes(token_ids, hash_block: int) -> list[bytes]:
    """One digest per full fine block: h_i = H(h_{i-1} || tokens of block i)."""
    out, h = [], b""
    for i in range(len(token_ids) // hash_block):
        blk = token_ids[i * hash_block: (i + 1) * hash_block]
        h = hashlib.blake2b(h + b"|" + ",".join(map(str, blk)).encode(), digest_size=16).digest()
        out.append(h)
    return out


class PrefixCache:
    def __init__(self, pool: BlockPool, hash_block: int = 512, checkpoint_every: int = 4):
        pt = pool.layout.page_tokens
        if hash_block < 1 or pt % hash_block:
            raise ValueError(f"page_tokens ({pt}) must be a multiple of hash_block ({hash_block})")
        if checkpoint_every < 1:
            raise ValueError(f"checkpoint_every must be >= 1, got {checkpoint_every}")
        self.pool, self.hash_block, self.checkpoint_every = pool, hash_block, checkpoint_every
        self.blocks: dict[bytes, int] = {}  # chain hash -> page holding that fine block
        self.checkpoints: dict[bytes, list[int]] = {}  # chain hash -> KDA state pages after that block
        self.page_keys: dict[int, set[bytes]] = {}  # page -> the keys that point into it
        pool.on_evict = self._evicted

    def is_checkpoint_boundary(self, tokens: int) -> bool:
        return tokens > 0 and tokens % (self.hash_block * self.checkpoint_every) == 0

    def lookup(self, token_ids, limit: int) -> PrefixHit:
        """Longest reusable boundary b <= limit (the engine keeps at least one prompt token to compute)."""
        hashes = chain_hashes(token_ids[:limit], self.hash_block)
        best, pages = 0, []
        for i, h in enumerate(hashes):
            page = self.blocks.get(h)
            if page is None:
                break
            pages.append(page)
            if h in self.checkpoints or not self.pool.layout.n_kda:  # a model without KDA needs no checkpoint
                best = i + 1
        if best == 0:
            return PrefixHit(0, [], None)
        ck = self.checkpoints.get(hashes[best - 1], [])
        block_pages = [p for p in pages[:best] if p != NO_PAGE]
        self.pool.touch(block_pages + ck)
        return PrefixHit(best * self.hash_block, block_pages, ck)

    def materialize(self, hit: PrefixHit) -> list[int]:
        """The requesting sequence's own page list for tokens [0, hit.tokens): a page whose fine blocks all come
        from one physical page and are all covered is shared (refcount + 1); any other page (the partial last
        one, or one assembled from blocks of different sources) is a fresh copy, so the sequence can append to
        it without touching what others read (copy-on-write)."""
        m = self.pool.layout.page_tokens // self.hash_block
        bpt = self.pool.layout.mla_bytes_per_token
        out = []
        for j in range(0, len(hit.block_pages), m):
            group = hit.block_pages[j: j + m]
            if len(group) == m and len(set(group)) == 1:
                self.pool.incref(group[:1])
                out.append(group[0])
                continue
            (dst,) = self.pool.alloc(1)
            for i, src in enumerate(group):
                lo, hi = i * self.hash_block * bpt, (i + 1) * self.hash_block * bpt
                self.pool.data[dst, lo:hi] = self.pool.data[src, lo:hi]
            out.append(dst)
        return out

    def insert_blocks(self, token_ids, pages: list[int], computed: int) -> None:
        """Register every full fine block among the first ``computed`` tokens (held in ``pages``)."""
        pt = self.pool.layout.page_tokens
        for i, h in enumerate(chain_hashes(token_ids[:computed], self.hash_block)):
            if h not in self.blocks:
                if not self.pool.layout.n_mla:  # an all-KDA model keeps no per-token state: only the hash matters
                    self.blocks[h] = NO_PAGE
                    continue
                page = pages[(i * self.hash_block) // pt]
                self.blocks[h] = page
                self.page_keys.setdefault(page, set()).add(h)
                self.pool.mark_cached([page])

    def insert_checkpoint(self, token_ids, tokens: int, kda_pages: list[int]) -> bool:
        """Keep ``kda_pages`` (already written, refcount held by the caller and dropped after) as the KDA
        state after ``tokens`` tokens. Returns False if one is already cached there."""
        h = chain_hashes(token_ids[:tokens], self.hash_block)[-1]
        if h in self.checkpoints:
            return False
        self.checkpoints[h] = list(kda_pages)
        for p in kda_pages:
            self.page_keys.setdefault(p, set()).add(h)
        self.pool.mark_cached(kda_pages)
        return True

    def _evicted(self, page: int) -> None:
        for h in self.page_keys.pop(page, ()):
            if self.blocks.get(h) == page:
                del self.blocks[h]
            ck = self.checkpoints.pop(h, None)
            if ck is not None:  # a checkpoint is useless without all of its pages
                others = [p for p in ck if p != page]
                for p in others:
                    self.page_keys.get(p, set()).discard(h)
                self.pool.uncache(others)

    @property
    def num_checkpoints(self) -> int:
        return len(self.checkpoints)
