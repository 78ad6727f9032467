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
