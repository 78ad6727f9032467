"""The grouped matmul op ``k3::grouped_mm`` (k3.ops.grouped_mm): the same products and gradients as autograd through
``torch._grouped_mm`` (which runs on CPU too), and the same as the per-expert loop the CPU path takes."""

import pytest
import torch

from k3.ops.grouped_mm import _expert_loop


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("column_major_x", [False, True])
def test_op_equals_autograd_through_torch_grouped_mm(dtype, column_major_x):
    """Forward, dx and dw bitwise equal to autograd's; groups of 0 rows and row counts that are no multiple of 8;
    an x handed over column-major (as a compiler may lay it out) gives the same."""
    torch.manual_seed(0)
    E, I, O = 4, 16, 24
    counts = torch.tensor([13, 0, 27, 5])
    offs = counts.cumsum(0).to(torch.int32)
    x = torch.randn(int(counts.sum()), I, dtype=dtype, requires_grad=True)
    w = torch.randn(E, O, I, dtype=dtype, requires_grad=True)
    ref = torch._grouped_mm(x, w.transpose(-1, -2), offs=offs)
    ours = torch.ops.k3.grouped_mm(x.t().contiguous().t() if column_major_x else x, w, offs)
    dy = torch.randn_like(ref)
    assert torch.equal(ours, ref)
    for a, b in zip(torch.autograd.grad(ours, (x, w), dy), torch.autograd.grad(ref, (x, w), dy)):
        assert torch.equal(a, b)


def test_op_equals_the_per_expert_loop():
    torch.manual_seed(1)
    counts = torch.tensor([3, 9, 0, 4])
    x, w = torch.randn(16, 8), torch.randn(4, 12, 8)
    torch.testing.assert_close(torch.ops.k3.grouped_mm(x, w, counts.cumsum(0).to(torch.int32)),
                               _expert_loop(x, w, counts))
