"""The page pool: its layout, reference counts and LRU, and the typed in-place views the kernels use."""

import pytest
import torch

from k3 import K3Config
from k3.inference.pool import ALIGN, OutOfPages, PageLayout, PagePool

LAY = PageLayout(n_mla=2, latent=6, n_kda=3, kda_heads=2, kda_dim=4, conv_width=4, page_tokens=24)


def test_layout_pages_and_records():
    assert LAY.mla_bytes_per_token == 2 * 6 * 4 and LAY.page_bytes == 1280  # 1152 bytes rounded up to ALIGN
    assert LAY.page_bytes % ALIGN == 0
    assert LAY.record_bytes == 512  # one KDA layer: 2*4*4 fp32 + 3*8*3 fp32 conv values = 416 bytes, aligned
    assert LAY.records_per_page == 2 and LAY.kda_pages == 2  # 3 layers, 2 records per page
    assert LAY.kda_state_bytes == 3 * (2 * 16 * 4 + 3 * 8 * 3 * 4)
    assert LAY.mla_pages(49) == 3
    with pytest.raises(ValueError, match="use page_tokens >= 11"):
        PageLayout(n_mla=2, latent=6, n_kda=3, kda_heads=2, kda_dim=4, conv_width=4, page_tokens=1)
    assert PageLayout(n_mla=2, latent=6, n_kda=3, kda_heads=2, kda_dim=4, conv_width=4, page_tokens=11).kda_pages == 3


def test_official_k3_layout():
    lay = PageLayout.from_config(K3Config.preset("kimi-k3"), page_tokens=1024, dtype=torch.bfloat16)
    assert lay.mla_bytes_per_token == 24 * 576 * 2  # 27 KB per token, as the report's serving numbers say
    assert lay.kda_state_bytes == 69 * (96 * 128 * 128 * 4 + 3 * 96 * 128 * 3 * 2)
    assert lay.records_per_page == 4 and lay.kda_pages == 18  # a 28 MB page holds 4 KDA layers' states


def test_refcounts_lru_and_eviction():
    pool = PagePool(LAY, 5)  # 4 usable + the scratch page
    a = pool.alloc(2)
    pool.mark_cached(a[:1])
    pool.decref(a)  # a[0] is cached: kept (evictable), a[1] is free
    assert pool.available == 4 and pool.pages_in_use == 0 and list(pool.lru) == [a[0]]
    evicted = []
    pool.on_evict = evicted.append
    got = pool.alloc(3)
    assert evicted == [] and pool.available == 1 and pool.scratch not in got  # free pages first, scratch never
    pool.alloc(1)
    assert evicted == [a[0]]
    with pytest.raises(OutOfPages, match="need 1 pages"):
        pool.alloc(1)
    p = PagePool(LAY, 2)
    q = p.alloc(1)
    p.decref(q)
    with pytest.raises(RuntimeError, match="released more often"):
        p.decref(q)


def test_typed_views_are_in_place_and_disjoint():
    pool = PagePool(LAY, 6)
    torch.manual_seed(0)
    mla = pool.mla_view()
    assert mla.shape == (6, 24, 2, 6) and mla.data_ptr() == pool.data.data_ptr()
    states = [pool.kda_state(l) for l in range(3)]
    convs = [pool.kda_conv(l) for l in range(3)]
    assert states[0].shape == (6, 2, 4, 4) and convs[0].shape == (6, 3, 8, 3)
    kda_pages = [3, 1]  # one request's KDA pages: layers 0-1 in page 3, layer 2 in page 1
    vals = {}
    for l in range(3):  # write every layer's state and tails through its view
        page = kda_pages[l // LAY.records_per_page]
        vals[l] = (torch.randn(2, 4, 4), torch.randn(3, 8, 3))
        states[l][page] = vals[l][0]
        convs[l][page] = vals[l][1]
    for l in range(3):  # nothing overwrote anything else, and the bytes are where the layout says
        page = kda_pages[l // LAY.records_per_page]
        assert torch.equal(states[l][page], vals[l][0]) and torch.equal(convs[l][page], vals[l][1])
        off = (l % LAY.records_per_page) * LAY.record_bytes
        assert torch.equal(pool.data[page, off: off + 128].view(torch.float32).view(2, 4, 4), vals[l][0])
        assert torch.equal(pool.data[page, off + 128: off + 416].view(torch.float32).view(3, 8, 3), vals[l][1])
    assert not pool.data[[0, 2, 4, 5]].any()  # other pages untouched
    pool.zero_kda(kda_pages)
    assert not pool.data.any()
