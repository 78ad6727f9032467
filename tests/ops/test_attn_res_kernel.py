"""The fused AttnRes mix + pre-norm (k3.ops.attn_res.attn_res_mix_norm_triton) against the reference: outputs and
the gradients of every source, the pseudo-query, its key norm and the pre-norm's weight. Triton's interpreter on
CPU (tests/conftest.py), compiled on a GPU; fp32 sources there (bf16 dots need a GPU), bf16 on the GPU too. Cases:
one source, several, the most (12), without the pre-norm (the final mix), a width that is not a power of two and
rows that are not whole blocks."""

import importlib.util

import pytest
import torch

from k3.ops.attn_res import attn_res_mix_norm_reference
from tests.conftest import assert_close

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")
DEV = "cuda" if torch.cuda.is_available() else "cpu"
CASES = [(1, 37, 48, True), (3, 37, 200, True), (5, 21, 64, False), (12, 9, 40, True)]


def _inputs(S, N, D, norm, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    scale = torch.rand(S, 1, 1, generator=g) * 3 + 0.2  # sources of different sizes, so the softmax is not flat
    sources = [(torch.randn(2, N, D, generator=g) * scale[i]).to(DEV, dtype).requires_grad_() for i in range(S)]
    query = (torch.randn(D, generator=g) / D ** 0.5 * 4).to(DEV).requires_grad_()
    key_norm = (torch.rand(D, generator=g) + 0.5).to(DEV).requires_grad_()
    norm_w = (torch.rand(D, generator=g) + 0.5).to(DEV).requires_grad_() if norm else None
    return sources, query, key_norm, norm_w


def _run(fn, sources, query, key_norm, norm_w, dy):
    y = fn(sources, query, key_norm, 1e-5, norm_w, 1e-6)
    params = sources + [query, key_norm] + ([norm_w] if norm_w is not None else [])
    return y, torch.autograd.grad(y, params, dy)


@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(torch.bfloat16, marks=pytest.mark.skipif(
    DEV != "cuda", reason="bf16: compiled Triton only"))], ids=["fp32", "bf16"])
@pytest.mark.parametrize("S,N,D,norm", CASES, ids=[f"S{s}-N{n}-D{d}-{'norm' if m else 'nonorm'}" for s, n, d, m in CASES])
def test_fused_mix_matches_the_reference_with_gradients(S, N, D, norm, dtype):
    from k3.ops.attn_res import attn_res_mix_norm_triton

    inputs = _inputs(S, N, D, norm, dtype)
    dy = torch.randn(2, N, D, generator=torch.Generator().manual_seed(5)).to(DEV, dtype)
    y_ref, g_ref = _run(attn_res_mix_norm_reference, *inputs, dy)
    y, g = _run(attn_res_mix_norm_triton, *inputs, dy)
    ratio = 1e-5 if dtype == torch.float32 else 1e-2  # RMS of the difference over RMS of the reference
    assert y.dtype == y_ref.dtype == dtype
    assert_close("output", y_ref, y, ratio)
    names = [f"source {i}" for i in range(S)] + ["query", "key norm", "pre-norm weight"]
    for name, a, b in zip(names, g, g_ref):
        assert a.dtype == b.dtype, name
        assert_close(name, b, a, ratio)


def test_the_dispatch_uses_the_reference_off_cuda_and_past_twelve_sources():
    from k3.ops.attn_res import attn_res_mix_norm

    sources, query, key_norm, norm_w = _inputs(13, 5, 16, True, torch.float32)
    with torch.no_grad():
        torch.testing.assert_close(attn_res_mix_norm(sources, query, key_norm, 1e-5, norm_w, 1e-6),
                                   attn_res_mix_norm_reference(sources, query, key_norm, 1e-5, norm_w, 1e-6))


ROW_CASES = [(2, 3, 48, True, False), (3, 5, 200, True, True), (5, 4, 64, False, True), (12, 2, 40, True, True),
             (1, 3, 37, True, True)]


@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(torch.bfloat16, marks=pytest.mark.skipif(
    DEV != "cuda", reason="bf16: compiled Triton only"))], ids=["fp32", "bf16"])
@pytest.mark.parametrize("S,N,D,norm,delta", ROW_CASES,
                         ids=[f"S{s}-N{n}-D{d}-{'norm' if m else 'nonorm'}-{'delta' if a else 'nodelta'}"
                              for s, n, d, m, a in ROW_CASES])
def test_inference_row_kernel_is_the_add_then_the_reference_mix(S, N, D, norm, delta, dtype):
    """k3::attn_res_rows (one program per row, online softmax over the sources) == the residual add (when a delta
    is given: last source + delta, rounded to the dtype) then the reference mix and pre-norm."""
    importlib.import_module("k3.ops.attn_res")  # registers the op

    sources, query, key_norm, norm_w = _inputs(S, N, D, norm, dtype)
    sources = [s.detach() for s in sources]
    d = torch.randn_like(sources[-1]) if delta else None
    with torch.no_grad():
        last = sources[-1] + d if delta else sources[-1]
        ref = attn_res_mix_norm_reference(sources[:-1] + [last], query, key_norm, 1e-5, norm_w, 1e-6)
        out, new_last = torch.ops.k3.attn_res_rows([s.reshape(-1, D) for s in sources],
                                                   d.reshape(-1, D) if delta else None, query, key_norm, norm_w,
                                                   1e-5, 1e-6)
    assert out.dtype == dtype and out.shape == (2 * N, D)
    assert_close("output", ref.reshape(-1, D), out, 1e-5 if dtype == torch.float32 else 1e-2)
    if delta:
        torch.testing.assert_close(new_last, last.reshape(-1, D), atol=0, rtol=0)  # the same rounded add
    else:
        assert new_last.numel() == 0


def test_depth_stream_with_the_add_in_the_mix_equals_the_plain_stream(monkeypatch):
    """A whole no-grad forward with the inference path (an InferenceMixer's PendingDepthStream: each write's add
    pending, done by the next read's row kernel; on CPU through Triton's interpreter) gives the logits of the plain
    stream (every add done at the write)."""
    import k3.inference.fast as depth
    import k3.ops.attn_res as ops
    from k3.config import K3Config
    from k3.model.transformer import K3ForCausalLM

    torch.manual_seed(0)
    cfg = K3Config.preset("tiny")
    model = K3ForCausalLM(cfg).to(DEV).eval()
    model.set_kda_backend("torch")  # (on a GPU: no fla autotuning for a test of the depth stream)
    for n, p in model.named_parameters():  # AttnRes queries start at zero (uniform mixing): give them a direction
        if n.endswith("res_proj.weight"):
            p.data.normal_(0, 0.5)
    ids = torch.randint(0, cfg.vocab_size, (2, 9), device=DEV)
    with torch.enable_grad():  # the plain stream: every add at its write (the row kernel is for inference only)
        ref = model(ids).logits.detach()

    class OwnAttention(depth.InferenceMixer):  # the layers' own token mixers, inference's depth stream
        def attend(self, layer, x):
            return layer.attend(x)

    calls = []
    real = ops._rows

    def counted(*a):
        calls.append(a[1] is not None)
        return real(*a)

    if DEV == "cpu":  # the kernels take CPU tensors only under the interpreter
        monkeypatch.setattr(depth, "kernel_applies", lambda sources: True)
        monkeypatch.setattr(ops, "kernel_applies", lambda sources: True)
    monkeypatch.setattr(ops, "_rows", counted)
    with torch.no_grad():
        fused = model(ids, mixer=OwnAttention()).logits
    assert calls and any(calls), "the row kernel never ran with a pending add"
    assert_close("logits", ref, fused, 1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["keep", "efficient"])
def test_sealed_blocks_sum_their_gradients_in_the_kernel(monkeypatch, policy):
    """A training forward and backward of the tiny model with every mix on the Triton kernels (on CPU through the
    interpreter) and each sealed block's gradient summed in place by the mixes' backward kernels (SourceGrad, no
    autograd add per reader) gives the loss and every gradient of the reference path (autograd sums them), also
    with the mixes recomputed in the backward (the efficient memory policy)."""
    from k3.train.memory import ActivationManager
    import k3.layers.depth.attn_res as depth
    import k3.ops.attn_res as ops
    from k3.config import K3Config
    from k3.model.transformer import K3ForCausalLM

    torch.manual_seed(0)
    cfg = K3Config.preset("tiny")
    model = K3ForCausalLM(cfg).to(DEV).train()
    model.set_kda_backend("torch")
    for n, p in model.named_parameters():  # AttnRes queries start at zero (uniform mixing): give them a direction
        if n.endswith("res_proj.weight"):
            p.data.normal_(0, 0.5)
    ids = torch.randint(0, cfg.vocab_size, (1, 24), device=DEV)
    manager = ActivationManager(policy)
    manager.attach(model)

    def run():
        model.zero_grad(set_to_none=True)
        with manager.forward():
            out = model(ids, labels=ids, return_logits=False)
        out["loss"].backward()
        return out["loss"].detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    ref_loss, ref = run()  # the reference mixes (stacked sources, autograd)
    summed = []
    real = ops._MixNorm.backward

    def counted(ctx, dy):
        summed.append(sum(s is not None and s.grad is not None for s in ctx.sinks))
        return real(ctx, dy)

    monkeypatch.setattr(ops, "uses_kernel", lambda sources: torch.is_grad_enabled())
    monkeypatch.setattr(depth, "uses_kernel", lambda sources: torch.is_grad_enabled())
    monkeypatch.setattr(ops._MixNorm, "backward", staticmethod(counted))
    loss, grads = run()
    assert sum(summed) > 0, "no mix added into a sealed block's gradient"
    assert_close("loss", ref_loss, loss, 1e-6)
    assert set(grads) == set(ref)
    for n, g in ref.items():
        assert_close(n, g, grads[n], 1e-5)
