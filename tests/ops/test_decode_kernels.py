"""The decode kernels against their references: paged MLA decode (our Triton kernel), the whole KDA decode step
(our fused Triton kernel), the fused expert and router kernels. Triton kernels run in Triton's interpreter on
CPU (tests/conftest.py sets TRITON_INTERPRET=1 where there is no GPU), so these run in CI; on a GPU they run
compiled. Each reference is itself tied to the model: the decode reference, step by step, equals the KDA layer's
forward over the whole sequence."""

import importlib.util

import pytest
import torch

from k3.ops.kda.decode import kda_decode_reference
from k3.ops.mla_decode import mla_decode_reference

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")
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


def _kda_inputs(B=3, H=2, K=16, W=4, P=6, dtype=torch.float32, seed=1, rf=None):
    """One decode step's inputs as the engine passes them: q, k, v, f and b column slices of one wider projection
    output (row stride != their width), state and conv tails strided slots of a pool of P > B pages, the index a
    column of a wider table, not sorted. With ``rf``, f is the gate's low-rank input f_a [B,rf] (a slice too)
    and ``f_b_weight`` [H*K,rf] its second projection."""
    g = torch.Generator().manual_seed(seed)

    def r(*shape, s=1.0):
        return (torch.randn(*shape, generator=g) * s).to(DEV)

    HK = H * K
    F = rf or HK
    wide = r(B, 3 * HK + F + H + 5).to(dtype)  # [q | k | v | f | b | 5 more], one row per decode row
    cut = [2, 2 + HK, 2 + 2 * HK, 2 + 3 * HK, 2 + 3 * HK + F, 2 + 3 * HK + F + H]
    pages = torch.randperm(P, generator=g)[:B]
    table = torch.stack([torch.full((B,), P + 3), pages, torch.full((B,), P + 4)], 1)
    f = wide[:, cut[3]:cut[4]]
    extra = dict(f_b_weight=r(HK, rf, s=rf ** -0.5).to(dtype)) if rf else {}
    return dict(q=wide[:, cut[0]:cut[1]], k=wide[:, cut[1]:cut[2]], v=wide[:, cut[2]:cut[3]],
                f=f if rf else f.view(B, H, K), b=wide[:, cut[4]:cut[5]],
                conv_weights=[r(HK, 1, W, s=0.5) for _ in range(3)], A_log=r(H, s=0.1), dt_bias=r(HK) - 3,
                state=r(P, 2, H, K, K, s=0.5)[:, 1], conv=r(P, 2, 3, HK, W - 1).to(dtype)[:, 0],
                index=table.to(DEV)[:, 1], **extra)


def _next_token(inp, seed):
    """The same pool and weights, the next token's projections (new values written into the same strided slices)."""
    g = torch.Generator().manual_seed(seed)
    for name in ("q", "k", "v", "f", "b"):
        inp[name].copy_(torch.randn(inp[name].shape, generator=g))
    return inp


@pytest.mark.slow
@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("gate", ["lower_bound", "softplus"])
@pytest.mark.parametrize("B,K,block_v,rf", [(1, 32, None, None), (3, 16, 8, None), (2, 32, 8, 24)],
                         ids=["B1-K32", "B3-K16-BV8", "B2-K32-BV8-fb"])
def test_fused_kda_decode_kernel_matches_reference_in_place(B, K, block_v, rf, gate, dtype):
    """Our one-kernel decode step against the reference over 5 consecutive tokens (W = 4: every tail position is
    shifted out at least once): outputs, states and conv tails, at slots of a larger pool (the others untouched).
    ``block_v`` = 8 splits each head's V over 2 or 4 programs, which share the q/k tails (the last to arrive
    shifts them: if none did, or one did early, the next token's conv would differ); ``rf``: the gate's second
    projection inside the kernel (f_a [B,24], not a power of two).
    fp32 to float rounding (1e-5 relative); with bf16 inputs both compute in fp32 (states to the same 1e-5) and
    round o to bf16, where a value may land one bf16 step (2^-7 relative) apart: o to 1e-2 relative. With the
    projection in the kernel and bf16, f too may round one bf16 step apart (its sum runs in another order), which
    moves that channel's decay: states to 5e-3 (of values ~1), o to 2e-3. The tails are the inputs themselves,
    shifted: exactly equal in either dtype."""
    from k3.ops.kda.decode import kda_decode_fused

    P = 6
    a, b = _kda_inputs(B=B, K=K, P=P, dtype=dtype, rf=rf), _kda_inputs(B=B, K=K, P=P, dtype=dtype, rf=rf)
    width = 3 * 2 * K + (rf or 2 * K) + 2 + 5
    assert all(b[n].stride(0) == width for n in ("q", "k", "v", "b"))  # slices of one wide row
    assert not b["state"].is_contiguous() and not b["conv"].is_contiguous()
    idx = b["index"].tolist()
    assert idx != sorted(idx) or B == 1
    untouched = [p for p in range(P) if p not in idx]
    state0, conv0 = b["state"][untouched].clone(), b["conv"][untouched].clone()
    tol = dict(atol=1e-6, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-3 if rf else 1e-5, rtol=1e-2)
    s_tol = dict(atol=1e-6, rtol=1e-5) if dtype == torch.float32 or not rf else dict(atol=5e-3, rtol=1e-2)
    for step in range(5):
        ref = kda_decode_reference(**_next_token(a, step), gate_kind=gate)
        out = kda_decode_fused(**_next_token(b, step), gate_kind=gate, block_v=block_v)
        assert out.dtype == dtype and out.shape == (B, 2, K)
        torch.testing.assert_close(out, ref, **tol)
        torch.testing.assert_close(b["state"], a["state"], **s_tol)  # in place, the same values
        assert torch.equal(b["conv"], a["conv"])  # tails shifted in place, exactly
    assert torch.equal(b["state"][untouched], state0) and torch.equal(b["conv"][untouched], conv0)


@needs_triton
def test_fused_kda_decode_projects_the_gate_outside_the_kernel_for_many_rows(monkeypatch):
    """Above FUSE_GATE_ROWS rows the gate's second projection is one F.linear before the kernel: the same values."""
    from k3.ops.kda import _decode_triton
    from k3.ops.kda.decode import kda_decode_fused

    monkeypatch.setattr(_decode_triton, "FUSE_GATE_ROWS", 1)
    a, b = _kda_inputs(B=3, rf=24), _kda_inputs(B=3, rf=24)
    ref = kda_decode_reference(**a)
    torch.testing.assert_close(kda_decode_fused(**b), ref, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(b["state"], a["state"], atol=1e-6, rtol=1e-5)


@needs_triton
def test_fused_kda_decode_names_what_is_wrong():
    from k3.ops.kda.decode import kda_decode_fused

    a = _kda_inputs()
    with pytest.raises(ValueError, match=r"v must be \[B,H\*K\] = \[3,32\]"):
        kda_decode_fused(**{**a, "v": a["v"][:, :-1]})
    with pytest.raises(ValueError, match="state must be .* fp32"):
        kda_decode_fused(**{**a, "state": a["state"].double()})
    with pytest.raises(ValueError, match="unknown KDA gate 'sigmoid'"):
        kda_decode_fused(**a, gate_kind="sigmoid")


def test_decode_dispatch_takes_the_reference_off_cuda_or_by_request(monkeypatch):
    """With backend "torch" (or K3_KDA_BACKEND=torch), and on CPU, the reference runs (exactly it); an unknown
    backend is named."""
    from k3.ops.kda import decode

    a, b = _kda_inputs(), _kda_inputs()
    torch.testing.assert_close(decode.kda_decode(**a, backend="torch"), kda_decode_reference(**b), atol=0, rtol=0)
    if DEV == "cpu":  # "auto" off CUDA: the reference too
        torch.testing.assert_close(decode.kda_decode(**a), kda_decode_reference(**b), atol=0, rtol=0)
    assert decode._wants_reference("auto", a["q"]) == (DEV == "cpu")
    monkeypatch.setenv("K3_KDA_BACKEND", "torch")
    assert decode._wants_reference("auto", a["q"]) and decode._wants_reference("torch", a["q"])
    with pytest.raises(ValueError, match="unknown KDA backend 'cuda'"):
        decode.kda_decode(**a, backend="cuda")


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
        o = kda_decode_reference(q[:, 0], k[:, 0], v[:, 0], f[:, 0], b[:, 0], (layer.q_conv1d.weight,
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
    # z large enough to reach SiTU's saturation, and a column slice of a wider row (as the engine's fused
    # projection gives it): the kernel reads its rows through their stride
    z = (torch.randn(N, cfg.expert_dim + 7, device=DEV) * 3)[:, 2:2 + cfg.expert_dim]
    assert not z.is_contiguous() or N == 1  # (one row: torch calls any slice of it contiguous)
    idx = torch.stack([torch.randperm(8)[:k] for _ in range(N)]).to(DEV)
    weights = torch.rand(N, k, device=DEV)
    ref = bank(z.contiguous(), weights, idx).detach()  # with a gradient (and on CPU) forward runs the grouped path
    with torch.no_grad():
        out = expert_decode(z, weights, idx, bank.w1, bank.w3, bank.w2, act, bank.b1, bank.b2).sum(1)
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
@pytest.mark.parametrize("E,k,renorm,scaling,N,dtype", [(32, 4, True, 1.0, 1, torch.float32),
                                                        (8, 2, True, 2.5, 3, torch.float32),
                                                        (40, 6, False, 1.7, 5, torch.float32),
                                                        (32, 4, True, 1.0, 2, torch.bfloat16)])
def test_fused_router_decode_matches_the_router(E, k, renorm, scaling, N, dtype):
    """The one-launch router kernel gives the reference router's choice, weights and scores (the bias changes the
    choice, never the weights); indices compared as sets, the reference's top-k being unordered. Its programs hand
    the top-k to the last of each token's E/4 to arrive: a second call (its counters reset by the first) gives
    the same. A bf16 model (its bias cast with it by ``.to``) is read as it is: the kernel widens the bias as the
    reference's fp32 sum does."""
    from k3 import K3Config
    from k3.layers.width.router import Router
    from k3.ops.router_decode import router_decode

    torch.manual_seed(5)
    cfg = K3Config.preset("tiny").replace(num_experts=E, num_experts_per_token=k, moe_renormalize=renorm,
                                          routed_scaling_factor=scaling)
    router = Router(cfg).to(DEV)
    router.e_score_correction_bias.copy_(torch.randn(E) * 0.05)
    router = router.to(dtype)
    assert router.e_score_correction_bias.dtype == dtype
    x = torch.randn(N, cfg.hidden_size, device=DEV, dtype=dtype)
    w_ref, i_ref, s_ref = router(x)  # on CPU (and with a gradient) the reference path runs
    with torch.no_grad():
        w, i, s = router_decode(x, router.weight, router.e_score_correction_bias, k, renorm, scaling)
        again = router_decode(x, router.weight, router.e_score_correction_bias, k, renorm, scaling)
    assert all(torch.equal(a, b) for a, b in zip(again, (w, i, s)))
    torch.testing.assert_close(s, s_ref.detach(), atol=1e-6, rtol=1e-5)
    order_ref, order = i_ref.sort(-1), i.sort(-1)
    assert torch.equal(order.values, order_ref.values)
    torch.testing.assert_close(w.gather(-1, order.indices), w_ref.detach().gather(-1, order_ref.indices), atol=1e-6,
                               rtol=1e-5)
    assert torch.equal(i[:, 0], (s_ref + router.e_score_correction_bias).argmax(-1))  # descending order
