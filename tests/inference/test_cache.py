"""The block pool and the prefix cache as data structures."""

import pytest
import torch

from k3.inference.cache import BlockPool, CacheLayout, OutOfPages, PrefixCache, chain_hashes

LAY = CacheLayout(n_mla=2, latent=6, n_kda=3, kda_heads=2, kda_dim=4, conv_width=4, page_tokens=8)


def test_layout_pages():
    assert LAY.mla_bytes_per_token == 2 * 6 * 4 and LAY.page_bytes == 8 * 48
    assert LAY.kda_state_bytes == 3 * (2 * 16 * 4 + 3 * 8 * 3 * 4)
    assert LAY.kda_pages == -(-LAY.kda_state_bytes // LAY.page_bytes)
    assert LAY.mla_pages(17) == 3


def test_refcounts_lru_and_eviction():
    pool = BlockPool(LAY, 4)
    a = pool.alloc(2)
    pool.mark_cached(a[:1])
    pool.decref(a)  # a[0] is cached: kept (evictable), a[1] is free
    assert pool.available == 4 and pool.pages_in_use == 0 and list(pool.lru) == [a[0]]
    evicted = []
    pool.on_evict = evicted.append
    pool.alloc(3)
    assert evicted == [] and pool.available == 1  # free pages are used before cached ones
    pool.alloc(1)
    assert evicted == [a[0]]
    with pytest.raises(OutOfPages, match="need 1 pages"):
        pool.alloc(1)
    with pytest.raises(RuntimeError, match="released more often"):
        p = BlockPool(LAY, 1)
        q = p.alloc(1)
        p.decref(q)
        p.decref(q)


def test_mla_and_kda_round_trip_through_bytes():
    pool = BlockPool(LAY, 8)
    pages = pool.alloc(3)
    x = torch.randn(19, 2, 6)
    pool.write_mla(pages, 0, x[:5])
    pool.write_mla(pages, 5, x[5:])
    torch.testing.assert_close(pool.read_mla(pages, 19), x)
    st, cv = torch.randn(3, 2, 4, 4), torch.randn(3, 3, 8, 3)
    kp = pool.alloc(LAY.kda_pages)
    pool.write_kda(kp, st, cv)
    s2, c2 = pool.read_kda(kp)
    torch.testing.assert_close(s2, st)
    torch.testing.assert_close(c2, cv)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_batched_access_equals_the_per_request_calls(dtype):
    """The engine's one-gather / one-scatter accessors against read_mla/write_mla/read_kda/write_kda, request by
    request; bytes past a request's length (here NaN patterns) never reach the batched read."""
    lay = CacheLayout(n_mla=2, latent=6, n_kda=3, kda_heads=2, kda_dim=4, conv_width=4, page_tokens=8, dtype=dtype)
    pool = BlockPool(lay, 40)
    pool.data.fill_(255)  # every float read from an unwritten byte is NaN
    torch.manual_seed(0)
    lengths = [19, 0, 8, 3]
    mla = [pool.alloc(lay.mla_pages(20)) for _ in lengths]  # room for one more token each
    xs = [torch.randn(n, 2, 6).to(dtype) for n in lengths]
    for pages, x in zip(mla, xs):
        pool.write_mla(pages, 0, x)
    S = max(lengths)
    lat = pool.read_mla_batch(mla, lengths, S)
    assert lat.shape == (4, S, 2, 6) and not lat.isnan().any()
    for b, n in enumerate(lengths):
        assert torch.equal(lat[b, :n], pool.read_mla(mla[b], n)) and not lat[b, n:].any()
    new = torch.randn(4, 2, 6).to(dtype)  # a decode step: one token per request at position lengths[b]
    pool.write_mla_tokens(mla, lengths, new)
    for b, n in enumerate(lengths):
        assert torch.equal(pool.read_mla(mla[b], n + 1), torch.cat([xs[b], new[b:b + 1]]))
    kda = [pool.alloc(lay.kda_pages) for _ in lengths]
    st, cv = torch.randn(3, 4, 2, 4, 4), torch.randn(3, 3, 4, 8, 3).to(dtype)  # [n_kda,B,...], [n_kda,3,B,...]
    pool.write_kda_batch(kda, st, cv)
    for b in range(4):
        s1, c1 = pool.read_kda(kda[b])
        assert torch.equal(s1, st[:, b]) and torch.equal(c1, cv[:, :, b])
    s2, c2 = pool.read_kda_batch(kda)
    assert torch.equal(s2, st) and torch.equal(c2, cv)


def test_prefix_lookup_needs_blocks_and_a_checkpoint_and_copies_on_write():
    pool = BlockPool(LAY, 32)
    pc = PrefixCache(pool, hash_block=4, checkpoint_every=1)
    toks = list(range(100, 120))
    pages = pool.alloc(3)  # 20 tokens in pages of 8
    pool.write_mla(pages, 0, torch.arange(20 * 12, dtype=torch.float32).view(20, 2, 6))
    pc.insert_blocks(toks, pages, 20)  # 5 fine blocks
    assert pc.lookup(toks, 19).tokens == 0  # no KDA checkpoint yet: no hit
    ck = pool.alloc(LAY.kda_pages)
    pc.insert_checkpoint(toks, 12, ck)
    pool.decref(ck)
    hit = pc.lookup(toks + [1, 2], 21)
    assert hit.tokens == 12 and hit.block_pages == [pages[0]] * 2 + [pages[1]]
    mine = pc.materialize(hit)
    assert mine[0] == pages[0] and mine[1] != pages[1]  # full page shared, partial page copied
    torch.testing.assert_close(pool.read_mla(mine, 12), pool.read_mla(pages, 12))
    other = toks[:9] + [0] * 11  # diverges inside block 2: reuse stops at 8, where there is no checkpoint
    assert pc.lookup(other, 19).tokens == 0


def test_evicting_one_page_of_a_checkpoint_drops_it_whole():
    pool = BlockPool(LAY, LAY.kda_pages + 2)
    pc = PrefixCache(pool, hash_block=4, checkpoint_every=1)
    toks = list(range(8))
    ck = pool.alloc(LAY.kda_pages)
    pc.insert_checkpoint(toks, 4, ck)
    pool.decref(ck)
    assert pc.num_checkpoints == 1
    pool.alloc(3)  # 2 free pages, then one eviction from the LRU
    assert pc.num_checkpoints == 0
    assert pool.available == LAY.kda_pages - 1  # the checkpoint's other pages went back to the free list


def test_chain_hash_depends_on_the_whole_prefix():
    a, b = chain_hashes([1, 2, 3, 4, 5, 6], 2), chain_hashes([9, 2, 3, 4, 5, 6], 2)
    assert len(a) == 3 and all(x != y for x, y in zip(a, b))
    with pytest.raises(ValueError, match="multiple of hash_block"):
        PrefixCache(BlockPool(LAY, 2), hash_block=3)
