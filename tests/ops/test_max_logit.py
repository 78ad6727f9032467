"""QK-clip's statistic (k3.ops.max_logit): the per-head max of q.k * scale over causal, within-document pairs.
The reference equals the brute-force masked maximum over all pairs; the Triton kernel (Triton's interpreter on
CPU, tests/conftest.py; compiled on a GPU) equals the reference, for packed documents (each position's document
start) and unpacked rows, with a head dim that is not a power of two and lengths that are not whole blocks."""

import importlib.util

import pytest
import torch

from k3.ops.max_logit import causal_max_logit_reference

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _starts(cu):
    cu = torch.tensor(cu)
    return torch.repeat_interleave(cu[:-1], cu.diff())


def _brute(q, k, scale, starts):
    T = q.shape[2]
    i, j = torch.arange(T)[:, None], torch.arange(T)[None, :]
    vis = (j <= i) & (j >= starts[:, None]) if starts is not None else j <= i
    s = (q.float() @ k.float().mT) * scale
    return s.masked_fill(~vis, float("-inf")).amax(dim=(0, 2, 3))


@pytest.mark.parametrize("cu", [None, [0, 30, 31, 100, 157], [0, 157]], ids=["rows", "docs4", "doc1"])
def test_reference_is_the_masked_max_over_pairs(cu):
    torch.manual_seed(0)
    B = 2 if cu is None else 1
    q, k = torch.randn(B, 3, 157, 24), torch.randn(B, 3, 157, 24)
    starts = _starts(cu) if cu else None
    want = _brute(q, k, 0.3, starts)
    torch.testing.assert_close(causal_max_logit_reference(q, k, 0.3, starts), want)
    torch.testing.assert_close(causal_max_logit_reference(q, k, 0.3, starts, chunk=16), want)
    if cu and 31 in cu:  # a document's later queries never see the earlier document: a huge key there must not count
        k2 = k.clone()
        k2[:, :, 30] = 1e4  # the 1-token document: only its own query sees it
        q2 = q.clone()
        q2[:, :, 30] = 0.0
        assert causal_max_logit_reference(q2, k2, 0.3, starts).max() < 1e3


@needs_triton
@pytest.mark.parametrize("cu,D,dtype", [(None, 96, torch.float32), ([0, 30, 31, 100, 157], 96, torch.float32),
                                        ([0, 70, 157], 40, torch.float32), ([0, 3, 157], 96, torch.float32),
                                        pytest.param([0, 20, 157], 96, torch.bfloat16, marks=pytest.mark.skipif(
                                            DEV != "cuda", reason="bf16 tensor-core dots: compiled Triton only"))],
                         ids=["rows-D96", "docs4-D96", "docs2-D40", "docs2-D96-unmasked-tiles", "docs2-D96-bf16"])
def test_triton_kernel_matches_the_reference(cu, D, dtype):
    from k3.ops.max_logit import causal_max_logit_triton

    torch.manual_seed(1)
    B = 2 if cu is None else 1
    # strided views, as MLA passes them: [B,T,H,D] transposed to [B,H,T,D]
    q = torch.randn(B, 157, 3, D, device=DEV).to(dtype).transpose(1, 2)
    k = torch.randn(B, 157, 3, D, device=DEV).to(dtype).transpose(1, 2)
    starts = _starts(cu).to(DEV) if cu else None
    ref = causal_max_logit_reference(q, k, 0.2, starts)
    out = causal_max_logit_triton(q, k, 0.2, starts)
    tol = dict(atol=1e-4, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-3, rtol=1e-3)
    torch.testing.assert_close(out, ref, **tol)
