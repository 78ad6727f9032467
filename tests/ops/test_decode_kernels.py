"""The decode kernels against their references: paged MLA decode (our Triton kernel), the KDA short convs (our
Triton kernel) and the in-place KDA recurrence (fla-core's fused kernel with state indices). Triton kernels run
in Triton's interpreter on CPU (tests/conftest.py sets TRITON_INTERPRET=1 where there is no GPU), so these
run in CI; on a GPU they run compiled. Each reference is itself tied to the model: the decode reference, step by
step, equals the KDA layer's forward over the whole sequence."""

import importlib.util

import pytest
import torch

from k3.ops.kda.decode import conv_decode_reference, kda_decode_reference
from k3.ops.mla_decode import mla_decode_reference

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")
needs_fla = pytest.mark.skipif(importlib.util.find_spec("fla") is None or importlib.util.find_spec("triton") is None,
                               reason="needs fla-core and triton")
DEV = "cuda" if torch.cuda.is_available() else "cpu"


@needs_triton
@pytest.mark.parametrize("B,H,R,Dr,Tp", [(3, 4, 32, 8, 16), (2, 6, 64, 16, 64), (1, 20, 32, 16, 8)],
                         ids=["B3-H4-R32", "B2-H6-R64", "B1-H20-R32"])
def test_paged_mla_decode_matches_reference(B, H, R, Dr, Tp):
    from k3.ops.mla_decode import mla_decode_triton

    P, layers = 12, 3
    pool = torch.randn(P, Tp, layers, R + Dr, device=DEV)
    cache = pool[:, :, 1]  # one MLA layer's slot of every page: strided, read in place
    lengths = torch.tensor([1, 37, 3 * Tp + 5][:B], device=DEV, dtype=torch.int32)
    table = torch.stack([torch.randperm(P) for _ in range(B)]).to(DEV, torch.int32)
    q, qp = torch.randn(B, H, R, device=DEV), torch.randn(B, H, Dr, device=DEV)
    ref = mla_decode_reference(q, qp, cache, table, lengths, 0.1)
    for splits in (1, 3, 8):  # slices past a short row's length contribute nothing
        out = mla_decode_triton(q, qp, cache, table, lengths, 0.1, splits=splits, block_n=16)
        torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)


def test_mla_decode_reference_is_attention_over_the_gathered_context():
    B, H, R, Dr, Tp, P = 2, 3, 8, 4, 4, 6
    cache, table = torch.randn(P, Tp, R + Dr), torch.tensor([[5, 2, 0], [1, 3, 4]])
    lengths = torch.tensor([9, 4])
    q, qp = torch.randn(B, H, R), torch.randn(B, H, Dr)
    out = mla_decode_reference(q, qp, cache, table, lengths, 0.5)
    for b in range(B):
        n = int(lengths[b])
        lat = torch.cat([cache[table[b, t // Tp], t % Tp][None] for t in range(n)])  # [n, R+Dr]
        s = (q[b] @ lat[:, :R].T + qp[b] @ lat[:, R:].T) * 0.5  # [H, n]
        torch.testing.assert_close(out[b], s.softmax(-1) @ lat[:, :R])


def _kda_inputs(B=3, H=2, K=16, W=4, P=6):
    torch.manual_seed(1)
    base = torch.randn(P, 2, H, K, K, device=DEV) * 0.1
    return dict(x3=torch.randn(B, 3, H * K, device=DEV), f=torch.randn(B, H, K, device=DEV),
                b=torch.randn(B, H, device=DEV), conv_weights=[torch.randn(H * K, 1, W, device=DEV) for _ in range(3)],
                A_log=torch.randn(H, device=DEV) * 0.1, dt_bias=torch.randn(H * K, device=DEV),
                state=base[:, 1], conv=torch.randn(P, 2, 3, H * K, W - 1, device=DEV)[:, 0],
                # a column of a wider table, as the engine passes it (one column per group of KDA layers)
                index=torch.tensor([[9, 4, 7], [9, 0, 7], [9, 2, 7]][:B], device=DEV)[:, 1])


@needs_triton
def test_short_conv_decode_kernel_matches_reference():
    from k3.ops.kda._decode_triton import conv_decode

    a, b = _kda_inputs(), _kda_inputs()
    ref = conv_decode_reference(a["x3"], a["conv_weights"], a["conv"], a["index"])
    out = conv_decode(b["x3"], b["conv_weights"], b["conv"], b["index"])
    torch.testing.assert_close(out.permute(1, 0, 2), ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(b["conv"], a["conv"], atol=0, rtol=0)  # tails shifted in place, other slots untouched


@needs_fla
@pytest.mark.parametrize("gate", ["lower_bound", "softplus"])
def test_fused_kda_decode_matches_reference_in_place(gate):
    from k3.ops.kda.decode import _kda_decode_fused

    a, b = _kda_inputs(), _kda_inputs()
    B, H, K = b["f"].shape
    # as the engine passes them: column slices of one fused projection's output rows (row stride != H*K, H)
    wide = torch.randn(B, H * K + H + 5, device=DEV)
    wide[:, 2: 2 + H * K], wide[:, 2 + H * K: 2 + H * K + H] = b["f"].reshape(B, -1), b["b"]
    b["f"], b["b"] = wide[:, 2: 2 + H * K].view(B, H, K), wide[:, 2 + H * K: 2 + H * K + H]
    assert not b["f"].is_contiguous() and not b["b"].is_contiguous()
    before = a["state"].clone()
    ref = kda_decode_reference(**a, gate_kind=gate)
    out = _kda_decode_fused(**b, gate_kind=gate, lower_bound=-5.0, scale=None)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(b["state"], a["state"], atol=2e-5, rtol=1e-4)  # updated in place, same values
    untouched = [p for p in range(6) if p not in (4, 0, 2)]
    assert torch.equal(b["state"][untouched], before[untouched])


def test_decode_reference_step_by_step_equals_the_layer_over_the_sequence():
    from k3 import K3Config
    from k3.layers.sequence.kda import KimiDeltaAttention

    torch.manual_seed(2)
    cfg = K3Config.preset("tiny")
    layer = KimiDeltaAttention(cfg).eval()
    x = torch.randn(2, 9, cfg.hidden_size)
    ref, _ = layer(x)
    H, K, W = layer.num_heads, layer.head_dim, cfg.short_conv_kernel_size
    state, conv = torch.zeros(5, H, K, K), torch.zeros(5, 3, H * K, W - 1)
    index = torch.tensor([3, 1])
    outs = []
    for t in range(x.shape[1]):
        q, k, v, f, b, gate = layer.projections(x[:, t: t + 1])
        o = kda_decode_reference(torch.cat([q, k, v], 1), f[:, 0], b[:, 0], (layer.q_conv1d.weight,
                                 layer.k_conv1d.weight, layer.v_conv1d.weight), layer.A_log, layer.dt_bias, state,
                                 conv, index, layer.gate_kind, layer.lower_bound)
        outs.append(layer.output(o[:, None], gate))
    torch.testing.assert_close(torch.cat(outs, 1), ref, atol=1e-5, rtol=1e-4)


@needs_triton
@pytest.mark.parametrize("act,N,k", [("situ", 3, 4), ("silu", 1, 2), ("situ", 5, 8)])
def test_fused_expert_decode_matches_the_grouped_path(act, N, k):
    from k3 import K3Config
    from k3.layers.width.latent_moe import ExpertBank
    from k3.ops.moe_decode import expert_decode

    torch.manual_seed(3)
    cfg = K3Config.preset("tiny").replace(hidden_act=act, num_experts=8, num_experts_per_token=k)
    bank = ExpertBank(cfg).to(DEV)
    z = torch.randn(N, cfg.expert_dim, device=DEV) * 3  # large enough to reach SiTU's saturation
    idx = torch.stack([torch.randperm(8)[:k] for _ in range(N)]).to(DEV)
    weights = torch.rand(N, k, device=DEV)
    ref = bank(z, weights, idx).detach()  # with a gradient (and on CPU) forward runs the grouped path
    with torch.no_grad():
        out = expert_decode(z, weights, idx, bank.w1, bank.w3, bank.w2, act, bank.b1, bank.b2)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)


@needs_triton
def test_append_then_attend_kernels_match_the_reference():
    """A decode step's MLA: the new token's latent written into its page (in place), then attention over the
    context including it: Triton's write + flash-decoding kernels against the reference's index_put + gather."""
    from k3.ops._mla_decode_triton import write_latents
    from k3.ops.mla_decode import mla_decode_append, mla_decode_triton

    B, H, R, Dr, Tp, P = 3, 4, 32, 8, 16, 10
    pool = torch.randn(P, Tp, 2, R + Dr, device=DEV)
    table = torch.stack([torch.randperm(P) for _ in range(B)]).to(DEV, torch.int32)
    positions = torch.tensor([0, 16, 37], device=DEV, dtype=torch.int32)  # the new token starts a page, too
    q, qp, new = torch.randn(B, H, R, device=DEV), torch.randn(B, H, Dr, device=DEV), torch.randn(B, R + Dr, device=DEV)
    ref_pool, tri_pool = pool.clone(), pool.clone()
    ref = mla_decode_append(q, qp, new, ref_pool[:, :, 0], table, positions, 0.2) if not pool.is_cuda else None
    if ref is None:  # on a GPU mla_decode_append is the Triton path: the reference is index_put + gather
        pos = positions.long()
        ref_pool[:, :, 0][table.gather(1, (pos // Tp)[:, None]).squeeze(1).long(), pos % Tp] = new
        ref = mla_decode_reference(q, qp, ref_pool[:, :, 0], table, pos + 1, 0.2)
    write_latents(new, tri_pool[:, :, 0], table, positions)
    out = mla_decode_triton(q, qp, tri_pool[:, :, 0], table, positions, 0.2, splits=4, block_n=16, length_offset=1)
    assert torch.equal(tri_pool, ref_pool)  # exactly the same bytes written, nothing else touched
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)


@needs_triton
@pytest.mark.parametrize("E,k,renorm,scaling,N", [(32, 4, True, 1.0, 1), (8, 2, True, 2.5, 3), (40, 6, False, 1.7, 5)])
def test_fused_router_decode_matches_the_router(E, k, renorm, scaling, N):
    """The two router kernels give the reference router's choice, weights and scores (the bias changes the choice,
    never the weights); indices compared as sets, the reference's top-k being unordered."""
    from k3 import K3Config
    from k3.layers.width.router import Router
    from k3.ops.router_decode import router_decode

    torch.manual_seed(5)
    cfg = K3Config.preset("tiny").replace(num_experts=E, num_experts_per_token=k, moe_renormalize=renorm,
                                          routed_scaling_factor=scaling)
    router = Router(cfg).to(DEV)
    router.e_score_correction_bias.copy_(torch.randn(E) * 0.05)
    x = torch.randn(N, cfg.hidden_size, device=DEV)
    w_ref, i_ref, s_ref = router(x)  # on CPU (and with a gradient) the reference path runs
    with torch.no_grad():
        w, i, s = router_decode(x, router.weight, router.e_score_correction_bias, k, renorm, scaling)
    torch.testing.assert_close(s, s_ref.detach(), atol=1e-6, rtol=1e-5)
    order_ref, order = i_ref.sort(-1), i.sort(-1)
    assert torch.equal(order.values, order_ref.values)
    torch.testing.assert_close(w.gather(-1, order.indices), w_ref.detach().gather(-1, order_ref.indices), atol=1e-6,
                               rtol=1e-5)
    assert torch.equal(i[:, 0], (s_ref + router.e_score_correction_bias).argmax(-1))  # descending order
