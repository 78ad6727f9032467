import torch
import torch.nn.functional as F

from k3.ops.situ import situ_glu, swiglu


def test_bounded_by_beta1_times_beta2():
    g = torch.randn(10000) * 1e4
    u = torch.randn(10000) * 1e4
    y = situ_glu(g, u, 4.0, 25.0)
    assert y.abs().max() <= 100.0
    assert y.abs().max() > 90.0  # and the bound is approached
    assert torch.isfinite(y).all()


def test_equals_swiglu_to_first_order_near_zero():
    g, u = torch.randn(1000, dtype=torch.float64), torch.randn(1000, dtype=torch.float64)
    errs = []
    for eps in (1e-1, 1e-2, 1e-3):
        d = (situ_glu(eps * g, eps * u) - swiglu(eps * g, eps * u)).abs().max().item()
        errs.append(d / eps**2)
        assert d <= 1e-2 * eps**2  # the difference is o(eps^2): both agree in value and slope at 0
    assert errs[2] < errs[0]


def test_tends_to_swiglu_as_betas_grow():
    g, u = torch.randn(1000, dtype=torch.float64) * 3, torch.randn(1000, dtype=torch.float64) * 3
    prev = None
    for b in (4.0, 40.0, 400.0, 4000.0, 40000.0):
        d = (situ_glu(g, u, b, b) - swiglu(g, u)).abs().max().item()
        assert prev is None or d < prev
        prev = d
    assert prev < 1e-5


def test_gradient_never_zero_where_a_clamp_would_be():
    g = torch.tensor([10.0, 20.0], dtype=torch.float64, requires_grad=True)
    u = torch.tensor([2.0, 2.0], dtype=torch.float64)
    situ_glu(g, u).sum().backward()
    assert (g.grad > 0).all()
    clamped = torch.tensor([30.0], requires_grad=True)
    (F.silu(clamped).clamp(max=4.0) * 2).sum().backward()
    assert clamped.grad.item() == 0.0


def test_fp32_compute_for_bf16_inputs():
    g, u = torch.randn(64).bfloat16(), torch.randn(64).bfloat16()
    y = situ_glu(g, u)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.float(), situ_glu(g.float(), u.float()), atol=1e-2, rtol=1e-2)
