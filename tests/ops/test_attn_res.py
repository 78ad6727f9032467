import torch

from k3.ops.attn_res import attn_res_merge, attn_res_mix, attn_res_partial


def test_zero_query_is_uniform_mean():
    src = torch.randn(5, 2, 3, 8)
    h = attn_res_mix(src, torch.zeros(8), torch.randn(8))
    torch.testing.assert_close(h, src.mean(0))


def test_softmax_weights_follow_rmsnormed_keys():
    src = torch.randn(4, 7, 16, dtype=torch.float64)
    w, nw = torch.randn(16, dtype=torch.float64), torch.rand(16, dtype=torch.float64) + 0.5
    keys = src / src.pow(2).mean(-1, keepdim=True).add(1e-5).sqrt() * nw
    p = (keys @ w).softmax(0)
    torch.testing.assert_close(attn_res_mix(src, w, nw), (p[..., None] * src).sum(0))


def test_batched_blocks_plus_online_merge_equals_full_mix():
    blocks, partial = torch.randn(3, 2, 5, 16), torch.randn(2, 5, 16)
    qs, ns = torch.randn(4, 16), torch.rand(4, 16) + 0.5
    o, lse = attn_res_partial(blocks, qs, ns)
    for i in range(4):
        merged = attn_res_merge(o[i], lse[i], partial, qs[i], ns[i])
        full = attn_res_mix(torch.cat([blocks, partial[None]]), qs[i], ns[i])
        torch.testing.assert_close(merged, full, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(o[i], attn_res_mix(blocks, qs[i], ns[i]), atol=1e-5, rtol=1e-5)


def test_logits_stay_fp32_under_autocast():
    """SPEC §3: AttnRes logits and softmax in fp32, also inside bf16 autocast (the CUDA training path)."""
    from k3.ops.attn_res import attn_res_logits

    src, q, w = torch.randn(3, 5, 16), torch.randn(16), torch.rand(16) + 0.5
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = attn_res_logits(src, q, w)
    assert got.dtype == torch.float32 and torch.equal(got, attn_res_logits(src, q, w))
