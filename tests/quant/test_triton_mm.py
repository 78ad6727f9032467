"""The Triton packed grouped matmul against the pure-torch reference, run on CPU tensors by Triton's interpreter
(TRITON_INTERPRET=1). Skipped when triton is not installed (it is in the `test` extra). Stated tolerance: fp32
summation order, rtol 1e-5 plus 1e-6 of the largest output (the decoded weights are exact in both)."""

import importlib
import sys

import pytest
import torch

from k3.ops.mx import quantize_mxfp4
from k3.quant.packed import packed_grouped_mm_reference

pytest.importorskip("triton", reason="triton not installed (pip install triton, or the `test` extra)")


@pytest.fixture
def kernels(monkeypatch):
    """k3.quant.triton_mm imported with the interpreter on (Triton reads TRITON_INTERPRET when it decorates)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.delitem(sys.modules, "k3.quant.triton_mm", raising=False)
    mod = importlib.import_module("k3.quant.triton_mm")
    yield mod
    sys.modules.pop("k3.quant.triton_mm", None)  # the next import decorates for the real device again


def test_tiles_cover_every_row_of_every_expert_once(kernels):
    counts = torch.tensor([0, 37, 1, 0, 16, 17])
    e, start, end = kernels._tiles(counts, 16, 103 // 16 + 1 + 6)
    rows = []
    for t in range(len(e)):
        if e[t] >= 0:
            span = range(int(start[t]), min(int(start[t]) + 16, int(end[t])))
            assert span, f"tile {t} of expert {int(e[t])} is empty"
            rows += [(int(e[t]), r) for r in span]
    owner = torch.arange(6).repeat_interleave(counts).tolist()
    assert rows == list(zip(owner, range(int(counts.sum()))))


@pytest.mark.parametrize("K, N", [(64, 48), (96, 32)], ids=["K64-N48", "K96-N32"])
def test_triton_kernel_equals_the_reference(kernels, K, N):
    torch.manual_seed(0)
    counts = torch.tensor([5, 0, 19, 2])
    w = torch.randn(4, N, K) * torch.exp2(torch.randint(-8, 8, (4, N, K // 32)).float()).repeat_interleave(32, -1)
    packed, scale = quantize_mxfp4(w)
    scale[0, 3, 0] = 0  # 2^-127: a subnormal scale
    scale[2, 1, 1] = 255  # the NaN scale: that output column of expert 2 is NaN
    x = torch.randn(int(counts.sum()), K)
    got = kernels.triton_packed_grouped_mm(x, packed, scale, counts)
    want = packed_grouped_mm_reference(x, packed, scale, counts)
    assert got.shape == want.shape == (26, N) and got[5:24, 1].isnan().all()
    scale_of_outputs = want.nan_to_num().abs().max().item()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6 * scale_of_outputs, equal_nan=True)
