"""k3.ops.linear_ce: the LM head + cross-entropy with its gradients computed in the forward equals autograd through
the plain logits and ``F.cross_entropy`` (loss, dh, dW), at any chunk size, with ignored targets, under bf16
autocast, and with either input frozen."""

import pytest
import torch
import torch.nn.functional as F

from k3.ops.linear_ce import linear_ce_sum


def reference(h, w, y):
    z = h @ w.t()
    return F.cross_entropy(z.to(torch.promote_types(z.dtype, torch.float32)), y, ignore_index=-100, reduction="sum")


def grads(fn, h, w, y, scale):
    h, w = h.detach().requires_grad_(), w.detach().requires_grad_()
    loss = fn(h, w, y)
    (loss * scale).backward()
    return loss.detach(), h.grad, w.grad


@pytest.mark.parametrize("chunk,pad", [(1, 1), (7, 1), (32, 1), (100, 1), (7, 64), (100, 8)])
def test_loss_and_gradients_equal_autograd_through_the_logits(chunk, pad):
    """``pad``: the vocabulary (37) run as 64 or 40 rows (CUDA pads to 64): zero rows, -inf logits, dropped."""
    torch.manual_seed(0)
    h, w = torch.randn(45, 16, dtype=torch.float64), torch.randn(37, 16, dtype=torch.float64)
    y = torch.randint(0, 37, (45,))
    y[[0, 5, 6, 44]] = -100  # ignored rows: no loss, no gradient
    ref = grads(reference, h, w, y, 0.37)  # a scale: the backward multiplies by the incoming gradient
    out = grads(lambda h, w, y: linear_ce_sum(h, w, y, chunk, pad_vocab=pad), h, w, y, 0.37)
    assert out[2].shape == w.shape
    for a, b, name in zip(out, ref, ("loss", "dh", "dW")):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12, msg=name)
    assert out[1][[0, 5, 6, 44]].abs().max() == 0  # an ignored row gets no gradient


def test_bf16_autocast_runs_the_gemms_in_bf16_and_returns_gradients_in_the_inputs_dtype():
    torch.manual_seed(1)
    h, w, y = torch.randn(64, 32), torch.randn(50, 32) * 0.3, torch.randint(0, 50, (64,))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = grads(reference, h, w, y, 1.0)
        out = grads(lambda h, w, y: linear_ce_sum(h, w, y, 24), h, w, y, 1.0)
    assert out[1].dtype == out[2].dtype == torch.float32 and out[0].dtype == torch.float32
    # both paths round the logits and G to bf16; the per-chunk dW partial sums are rounded in a different order
    torch.testing.assert_close(out[0], ref[0], rtol=2e-3, atol=0)
    for a, b, name in zip(out[1:], ref[1:], ("dh", "dW")):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2, msg=name)


def test_a_frozen_input_gets_no_gradient_and_the_other_is_exact():
    torch.manual_seed(2)
    h, w = torch.randn(20, 8, dtype=torch.float64), torch.randn(11, 8, dtype=torch.float64)
    y = torch.randint(0, 11, (20,))
    hw = h.clone().requires_grad_()
    linear_ce_sum(hw, w, y, 6).backward()  # w frozen (a frozen head)
    ref = grads(reference, h, w, y, 1.0)
    torch.testing.assert_close(hw.grad, ref[1])
    ww = w.clone().requires_grad_()
    linear_ce_sum(h, ww, y, 6).backward()  # h frozen
    torch.testing.assert_close(ww.grad, ref[2])
    with torch.no_grad():
        torch.testing.assert_close(linear_ce_sum(h, w, y, 6), ref[0])


def test_bad_shapes_are_named():
    with pytest.raises(ValueError, match="pad_vocab must be >= 1"):
        linear_ce_sum(torch.zeros(2, 4), torch.zeros(3, 4), torch.zeros(2, dtype=torch.long), pad_vocab=0)
    h, w = torch.randn(4, 8), torch.randn(5, 8)
    with pytest.raises(ValueError, match="h \\[N,D\\] and w \\[V,D\\]"):
        linear_ce_sum(h, torch.randn(5, 7), torch.zeros(4, dtype=torch.long))
    with pytest.raises(ValueError, match="targets must be \\[N\\]"):
        linear_ce_sum(h, w, torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match="chunk must be >= 1"):
        linear_ce_sum(h, w, torch.zeros(4, dtype=torch.long), 0)
