import pytest
import torch

from k3 import K3Config
from k3.layers.sequence.kda import KimiDeltaAttention
from k3.layers.sequence.mla import GatedMLA, attend_documents, max_causal_logit
from k3.ops.varlen import document_ids


@pytest.mark.parametrize("gate", ["lower_bound", "softplus"])
def test_kda_decode_token_by_token_equals_full_forward(gate):
    cfg = K3Config.preset("tiny").variant(gate=gate)
    layer = KimiDeltaAttention(cfg).eval()
    x = torch.randn(2, 19, cfg.hidden_size)
    full, _ = layer(x)
    y1, st = layer(x[:, :7], output_state=True)  # chunked prefill
    outs = [y1]
    for t in range(7, 19):  # then decode, one token at a time on the fixed-size state
        yt, st = layer(x[:, t:t + 1], state=st)
        outs.append(yt)
    torch.testing.assert_close(torch.cat(outs, 1), full, atol=1e-5, rtol=1e-4)
    assert st.recurrent.shape == (2, cfg.kda_num_heads, cfg.kda_head_dim, cfg.kda_head_dim)


def test_kda_packed_documents_are_independent():
    cfg = K3Config.preset("tiny")
    layer = KimiDeltaAttention(cfg)
    a, b = torch.randn(1, 9, cfg.hidden_size), torch.randn(1, 14, cfg.hidden_size)
    packed, _ = layer(torch.cat([a, b], 1), cu_seqlens=torch.tensor([0, 9, 23]))
    torch.testing.assert_close(packed[:, :9], layer(a)[0], atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(packed[:, 9:], layer(b)[0], atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("preset", ["tiny", "kimi-k2-like"])
def test_mla_absorbed_equals_naive(preset):
    cfg = K3Config.preset("tiny")
    if preset == "kimi-k2-like":
        cfg = cfg.replace(mla_use_nope=False, mla_use_output_gate=False, q_lora_rank=None)
    layer = GatedMLA(cfg).eval()
    x = torch.randn(2, 10, cfg.hidden_size)
    pos = torch.arange(10)[None].expand(2, 10)
    naive = layer(x, positions=pos)
    c_kv, k_pe = layer.project(x, pos)[2:4]
    mask = torch.ones(10, 10, dtype=torch.bool).tril()[None].expand(2, 10, 10)
    absorbed = layer.attend_absorbed(x, c_kv, k_pe, mask, pos)
    torch.testing.assert_close(absorbed, naive, atol=1e-5, rtol=1e-4)


def test_mla_cache_is_position_independent_with_nope():
    cfg = K3Config.preset("tiny")
    layer = GatedMLA(cfg)
    x = torch.randn(1, 5, cfg.hidden_size)
    c1, p1 = layer.project(x)[2:4]
    c2, p2 = layer.project(x, torch.arange(100, 105)[None])[2:4]
    torch.testing.assert_close(c1, c2)
    torch.testing.assert_close(p1, p2)
    assert c1.shape[-1] + p1.shape[-1] == cfg.kv_lora_rank + cfg.qk_rope_head_dim


def test_mla_packed_documents_are_independent():
    cfg = K3Config.preset("tiny")
    layer = GatedMLA(cfg)
    a, b = torch.randn(1, 6, cfg.hidden_size), torch.randn(1, 8, cfg.hidden_size)
    packed = layer(torch.cat([a, b], 1), cu_seqlens=torch.tensor([0, 6, 14]))
    torch.testing.assert_close(packed[:, :6], layer(a), atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(packed[:, 6:], layer(b), atol=1e-5, rtol=1e-4)
    assert document_ids(torch.tensor([0, 2, 5, 5, 7]), 7, "cpu").tolist() == [0, 0, 1, 1, 1, 3, 3]


@pytest.mark.parametrize("overhead", [0.0, 30.0 ** 2, float("inf")], ids=["every-length-alone", "grouped", "one-pad"])
def test_mla_document_groups_equal_attention_per_document(overhead):
    """attend_documents, whatever the grouping (each length alone, grouped by cost, everything padded to the
    longest), equals causal SDPA run on each document by itself: outputs, q/k/v gradients, QK-clip's max logit."""
    torch.manual_seed(0)
    cu = torch.tensor([0, 37, 40, 41, 90, 90, 97, 150, 153])  # lengths 37 3 1 49 0 7 53 3: several groups
    H, T = 3, int(cu[-1])
    q, k = torch.randn(1, H, T, 10, dtype=torch.float64), torch.randn(1, H, T, 10, dtype=torch.float64)
    v, do = torch.randn(1, H, T, 6, dtype=torch.float64), torch.randn(1, H, T, 6, dtype=torch.float64)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    o, m = attend_documents(*leaves, cu, 0.7, track_max_logit=True, overhead=overhead)
    (o * do).sum().backward()
    ref_leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    parts, ref_m = [], torch.full((H,), float("-inf"), dtype=torch.float32)
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
        if b > a:
            qa, ka, va = (x[:, :, a:b] for x in ref_leaves)
            parts.append(torch.nn.functional.scaled_dot_product_attention(qa, ka, va, is_causal=True, scale=0.7))
            ref_m = torch.maximum(ref_m, max_causal_logit(qa, ka, 0.7))
    ref = torch.cat(parts, dim=2)
    (ref * do).sum().backward()
    torch.testing.assert_close(o, ref)
    torch.testing.assert_close(m, ref_m)
    for name, a, b in zip("qkv", ref_leaves, leaves):
        torch.testing.assert_close(b.grad, a.grad, msg=f"d{name}")


def test_mla_packed_documents_need_batch_one():
    cfg = K3Config.preset("tiny")
    with pytest.raises(ValueError, match="batch 1"):
        GatedMLA(cfg)(torch.randn(2, 6, cfg.hidden_size), cu_seqlens=torch.tensor([0, 2, 6]))
