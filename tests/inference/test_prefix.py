"""The prefix cache as a data structure: chain hashes, hits that need blocks AND a checkpoint, copy on write,
eviction, and the write-back tier in host memory."""

import pytest
import torch

from k3.inference.pool import HostPool, PageLayout, PagePool
from k3.inference.prefix import PrefixCache, chain_hashes, extend_hashes

LAY = PageLayout(n_mla=2, latent=6, n_kda=3, kda_heads=2, kda_dim=4, conv_width=4, page_tokens=24)  # 2 KDA pages
HB = 8  # hash block: 3 fine blocks per page


def _write(pool, pages, n):
    """Distinct latents for tokens [0, n) of a sequence held in ``pages``; returns them [n, 2, 6]."""
    x = torch.randn(n, 2, 6)
    pool.mla_view()[torch.tensor([pages[t // 24] for t in range(n)]), torch.arange(n) % 24] = x
    return x


def _read(pool, pages, n):
    return pool.mla_view()[torch.tensor([pages[t // 24] for t in range(n)]), torch.arange(n) % 24]


def test_chain_hashes_are_incremental_and_depend_on_the_whole_prefix():
    a, b = chain_hashes([1, 2, 3, 4, 5, 6], 2), chain_hashes([9, 2, 3, 4, 5, 6], 2)
    assert len(a) == 3 and all(x != y for x, y in zip(a, b))
    grown = extend_hashes([], [1, 2, 3], 2)
    assert extend_hashes(grown, [1, 2, 3, 4, 5, 6, 7], 2) == a  # only the new blocks are hashed
    with pytest.raises(ValueError, match="multiple of hash_block"):
        PrefixCache(PagePool(LAY, 3), hash_block=5)


def test_lookup_needs_blocks_and_a_checkpoint_and_copies_on_write():
    torch.manual_seed(0)
    pool = PagePool(LAY, 32)
    pc = PrefixCache(pool, hash_block=HB, checkpoint_every=1)
    toks = list(range(100, 140))
    pages = pool.alloc(2)  # 40 tokens in pages of 24
    x = _write(pool, pages, 40)
    hashes = chain_hashes(toks, HB)  # 5 fine blocks
    pc.insert_blocks(hashes, pages)
    assert pc.lookup(hashes, 39).tokens == 0  # no KDA checkpoint yet: no hit
    ck = pool.alloc(LAY.kda_pages)
    pc.insert_checkpoint(hashes[3], ck)  # the state after 32 tokens
    pool.decref(ck)
    hit = pc.lookup(chain_hashes(toks + [1, 2], HB), 41)
    assert hit.tokens == 32 and [b.page for b in hit.blocks] == [pages[0]] * 3 + [pages[1]]
    mine = pc.materialize(hit)
    assert mine[0] == pages[0] and mine[1] != pages[1]  # full page shared, partial page copied
    assert torch.equal(_read(pool, mine, 32), x[:32])
    other = chain_hashes(toks[:17] + [0] * 23, HB)  # diverges inside block 2: reuse stops at 16, no checkpoint
    assert pc.lookup(other, 39).tokens == 0


def test_evicting_one_page_of_a_checkpoint_drops_it_whole_without_a_host_tier():
    pool = PagePool(LAY, LAY.kda_pages + 3)
    pc = PrefixCache(pool, hash_block=HB, checkpoint_every=1)
    ck = pool.alloc(LAY.kda_pages)
    pc.insert_checkpoint(chain_hashes(list(range(8)), HB)[0], ck)
    pool.decref(ck)
    assert pc.num_checkpoints == 1
    pool.alloc(3)  # 2 free pages, then one eviction from the LRU
    assert pc.num_checkpoints == 0
    assert pool.available == LAY.kda_pages - 1  # the checkpoint's other pages went back to the free list


def test_write_back_tier_keeps_evicted_prefixes_and_brings_them_back_bit_exact():
    torch.manual_seed(1)
    pool = PagePool(LAY, 6)  # 5 usable pages
    host = HostPool(LAY.page_bytes, 8)
    pc = PrefixCache(pool, hash_block=HB, checkpoint_every=3, host=host)
    toks = list(range(48))
    hashes = chain_hashes(toks, HB)
    pages = pool.alloc(2)
    x = _write(pool, pages, 48)
    pc.insert_blocks(hashes, pages)
    ck = pool.alloc(LAY.kda_pages)
    state = torch.randn(2, 4, 4)
    pool.kda_state(0)[ck[0]] = state
    pc.insert_checkpoint(hashes[5], ck)  # after 48 tokens
    pool.decref(ck)
    pool.decref(pages)  # the sequence ended: 4 cached pages, all in the LRU
    taken = pool.alloc(5)  # the device needs every page: all four move to the host tier
    assert host.pages_in_use == 4 and pc.num_checkpoints == 1
    hit = pc.lookup(chain_hashes(toks + [7], HB), 48)
    assert hit.tokens == 48 and all(b.page is None for b in hit.blocks)
    pool.decref(taken)
    mine = pc.materialize(hit)
    assert torch.equal(_read(pool, mine, 48), x)
    kda = pool.alloc(LAY.kda_pages)
    pc.restore_checkpoint(hit, kda)
    assert torch.equal(pool.kda_state(0)[kda[0]], state)
    pc.insert_blocks(hashes, mine)  # the blocks are on the device again (in this sequence's pages)
    assert all(pc.blocks[h].page in mine for h in hashes) and host.pages_in_use == 2  # the checkpoint stays
    # a full host tier forgets its oldest pages: a checkpoint goes with any of its pages, and leaves nothing behind
    small = HostPool(LAY.page_bytes, 1)
    pool2 = PagePool(LAY, LAY.kda_pages + 2)
    pc2 = PrefixCache(pool2, hash_block=HB, checkpoint_every=1, host=small)
    ck2 = pool2.alloc(LAY.kda_pages)
    pc2.insert_checkpoint(hashes[0], ck2)
    pool2.decref(ck2)
    pool2.alloc(pool2.usable)
    assert pc2.num_checkpoints == 0 and small.pages_in_use == 0 and not pc2.host_keys
