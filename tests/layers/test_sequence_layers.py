import pytest
import torch

from k3 import K3Config
from k3.layers.sequence.kda import KimiDeltaAttention
from k3.layers.sequence.mla import GatedMLA, attend_documents
from k3.ops.max_logit import causal_max_logit_reference as max_causal_logit
from k3.ops.varlen import document_ids


@pytest.mark.slow
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


@pytest.mark.slow
@pytest.mark.parametrize("packed", [False, True], ids=["rows", "packed"])
def test_kda_stacked_conv_equals_three_convs(packed, monkeypatch):
    """Without a decode state the layer convolves q, k, v as one depthwise conv over the stacked channels
    (``stateless_inputs``, the conv's SiLU applied in ``activations``): the output and every gradient equal the
    stateful path's (each conv its own, with its tail and the SiLU inside), and the short conv runs once instead of
    three times."""
    import k3.layers.sequence.kda as kda_layer

    cfg = K3Config.preset("tiny")
    layer = KimiDeltaAttention(cfg)
    x = torch.randn(1 if packed else 2, 23, cfg.hidden_size, requires_grad=True)
    cu = torch.tensor([0, 9, 23]) if packed else None
    calls = []
    real = kda_layer.short_conv
    monkeypatch.setattr(kda_layer, "short_conv", lambda *a, **k: calls.append(a[1].shape[0]) or real(*a, **k))
    outs, HK = [], cfg.kda_num_heads * cfg.kda_head_dim
    for want in (False, True):  # stacked; per projection (output_state asks for each conv's tail)
        calls.clear()
        layer.zero_grad()
        x.grad = None
        y, _ = layer(x, cu_seqlens=cu, output_state=want)
        (y * torch.randn_like(y, generator=torch.Generator().manual_seed(0))).sum().backward()
        outs.append((y.detach(), x.grad.clone(), {n: p.grad.clone() for n, p in layer.named_parameters()}))
        assert calls == ([HK] * 3 if want else [3 * HK])  # the conv's channels per call
    (y0, dx0, g0), (y1, dx1, g1) = outs
    torch.testing.assert_close(y0, y1, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(dx0, dx1, atol=1e-6, rtol=1e-5)
    for n in g1:  # one GEMM over the stacked weights sums in another order: fp32 rounding (measured 2.6e-6 at ~14)
        torch.testing.assert_close(g0[n], g1[n], atol=1e-5, rtol=1e-5, msg=n)


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


def _reference_varlen_attn(calls):
    """torch.nn.attention.varlen.varlen_attn's documented semantics on CPU (per-document SDPA), recording its
    arguments: the kernel itself runs only on CUDA."""
    import torch.nn.functional as F

    def varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, window_size=(-1, -1)):
        calls.append({"cu_dtype": cu_q.dtype, "max": (max_q, max_k), "window": window_size, "dims": (q.shape[-1], v.shape[-1])})
        assert torch.equal(cu_q, cu_k) and q.shape[-1] == k.shape[-1] == v.shape[-1]  # flash: one head dim
        out = torch.empty_like(q)
        for a, b in zip(cu_q.tolist(), cu_q.tolist()[1:]):
            qd, kd, vd = (x[a:b].transpose(0, 1) for x in (q, k, v))  # [H,L,D]
            out[a:b] = F.scaled_dot_product_attention(qd, kd, vd, is_causal=window_size == (-1, 0),
                                                      scale=scale).transpose(0, 1)
        return out

    return varlen_attn


def test_mla_varlen_path_equals_the_grouped_path(monkeypatch):
    """GatedMLA over packed documents through the flash varlen call (CUDA only; here the kernel's documented
    semantics stand in for it) equals the length-grouped SDPA path: outputs, gradients, QK-clip's max logits.
    Checks the glue: [T,H,D] layout, v padded to the q/k head dim and cut back, int32 offsets, host-side max
    length, causal window."""
    import k3.layers.sequence.mla as mla_mod

    cfg = K3Config.preset("tiny")
    torch.manual_seed(0)
    from k3.layers.stats import Statistics

    layer = GatedMLA(cfg).train()
    x = torch.randn(1, 40, cfg.hidden_size)
    cu = torch.tensor([0, 7, 8, 30, 40])
    runs = []
    for varlen in (False, True):
        calls = []
        monkeypatch.setattr(mla_mod, "varlen_attention_available", lambda q: varlen)
        monkeypatch.setattr(mla_mod, "_varlen_kernel", lambda: _reference_varlen_attn(calls))
        layer.zero_grad(set_to_none=True)
        stats = Statistics(("max_logit",))
        y = layer(x, cu, stats=stats)
        (y * torch.linspace(-1, 1, y.shape[-1])).sum().backward()
        runs.append((y, {n: p.grad.clone() for n, p in layer.named_parameters()}, stats.max_logit[0], calls))
    (y0, g0, m0, c0), (y1, g1, m1, c1) = runs
    assert c0 == [] and c1 == [{"cu_dtype": torch.int32, "max": (22, 22), "window": (-1, 0),
                                "dims": (cfg.qk_head_dim, cfg.qk_head_dim)}]
    torch.testing.assert_close(y1, y0, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(m1, m0, atol=1e-6, rtol=1e-6)
    for n, g in g0.items():
        torch.testing.assert_close(g1[n], g, atol=1e-5, rtol=1e-5, msg=n)


def test_mla_varlen_path_needs_cuda_half_precision():
    from k3.layers.sequence.mla import varlen_attention_available

    assert not varlen_attention_available(torch.zeros(1, 2, 8, 32))  # CPU fp32: the grouped path
