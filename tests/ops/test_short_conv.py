import importlib.util

import pytest
import torch
import torch.nn.functional as F

from k3.ops.short_conv import short_conv


def loop_conv(x, w, state=None):
    """y_t = silu(sum_i w[:, i] x_{t-W+1+i}), zeros (or the state) before the start."""
    B, T, D = x.shape
    W = w.shape[-1]
    hist = torch.zeros(B, W - 1, D) if state is None else state.transpose(1, 2)
    xs = torch.cat([hist, x], 1)
    return F.silu(torch.stack([(xs[:, t:t + W] * w[:, 0].T).sum(1) for t in range(T)], 1))


def test_matches_loop_and_state_continues():
    x, w = torch.randn(2, 11, 6), torch.randn(6, 1, 4)
    y, s = short_conv(x, w, output_final_state=True)
    torch.testing.assert_close(y, loop_conv(x, w))
    torch.testing.assert_close(s, x[:, -3:].transpose(1, 2))
    y1, s1 = short_conv(x[:, :5], w, output_final_state=True)
    y2, _ = short_conv(x[:, 5:], w, state=s1, output_final_state=True)
    torch.testing.assert_close(torch.cat([y1, y2], 1), y)
    # decode: one token at a time
    s, ys = None, []
    for t in range(11):
        yt, s = short_conv(x[:, t:t + 1], w, state=s, output_final_state=True)
        ys.append(yt)
    torch.testing.assert_close(torch.cat(ys, 1), y)


def test_packed_never_crosses_documents():
    x, w = torch.randn(1, 12, 4), torch.randn(4, 1, 4)
    cu = torch.tensor([0, 2, 9, 12])
    state = torch.randn(3, 4, 3)
    y, s = short_conv(x, w, state=state, cu_seqlens=cu, output_final_state=True)
    for n in range(3):
        a, b = cu[n], cu[n + 1]
        yn, sn = short_conv(x[:, a:b], w, state=state[n:n + 1], output_final_state=True)
        torch.testing.assert_close(y[:, a:b], yn)
        torch.testing.assert_close(s[n:n + 1], sn)


def test_bad_state_shape():
    with pytest.raises(ValueError, match="state must be"):
        short_conv(torch.randn(1, 3, 4), torch.randn(4, 1, 4), state=torch.zeros(1, 4, 2))


@pytest.mark.parametrize("W", [1, 2, 4])
@pytest.mark.parametrize("with_state", [False, True])
def test_packed_without_padding_equals_each_document_alone_with_gradients(W, with_state):
    """Documents shorter than W-1, one token long, empty, and long ones; outputs, final states and the gradients of
    x, the weight and the states equal running every document alone."""
    torch.manual_seed(W)
    cu = torch.tensor([0, 1, 3, 3, 10, 12, 20])  # lengths 1, 2, 0, 7, 2, 8
    N, D = len(cu) - 1, 5
    x = torch.randn(1, 20, D, dtype=torch.float64, requires_grad=True)
    w = torch.randn(D, 1, W, dtype=torch.float64, requires_grad=True)
    state = torch.randn(N, D, W - 1, dtype=torch.float64, requires_grad=True) if with_state else None
    y, s = short_conv(x, w, state=state, cu_seqlens=cu, output_final_state=True)
    gy, gs = torch.randn_like(y), torch.randn_like(s)
    ((y * gy).sum() + (s * gs).sum()).backward()
    leaves = [x, w] + ([state] if with_state else [])
    grads = [t.grad.clone() for t in leaves]
    for t in leaves:
        t.grad = None
    total = 0
    for n in range(N):
        a, b = int(cu[n]), int(cu[n + 1])
        st = state[n:n + 1] if with_state else None
        if a == b:  # an empty document keeps its state
            torch.testing.assert_close(s[n:n + 1], st if with_state else torch.zeros(1, D, W - 1, dtype=x.dtype))
            total = total + ((st * gs[n:n + 1]).sum() if with_state else 0)
            continue
        yn, sn = short_conv(x[:, a:b], w, state=st, output_final_state=True)
        torch.testing.assert_close(y[:, a:b], yn)
        torch.testing.assert_close(s[n:n + 1], sn)
        total = total + (yn * gy[:, a:b]).sum() + (sn * gs[n:n + 1]).sum()
    total.backward()
    for name, got, t in zip(["dx", "dw", "dstate"], grads, leaves):
        torch.testing.assert_close(got, t.grad, msg=name)


def test_packed_bf16_sums_in_fp32_and_needs_batch_one():
    torch.manual_seed(0)
    x, w, cu = torch.randn(1, 64, 8), torch.randn(8, 1, 4), torch.tensor([0, 30, 64])
    ref, _ = short_conv(x, w, cu_seqlens=cu)
    out, _ = short_conv(x.bfloat16(), w.bfloat16(), cu_seqlens=cu)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref, rtol=2e-2, atol=2e-2)
    with pytest.raises(ValueError, match="batch 1"):
        short_conv(torch.randn(2, 8, 8), w, cu_seqlens=torch.tensor([0, 8]))
    with pytest.raises(ValueError, match="number of documents"):
        short_conv(x, w, state=torch.zeros(3, 8, 3), cu_seqlens=cu)


def test_packed_edge_cases_int32_boundaries_and_no_tokens():
    x, w = torch.randn(1, 9, 4), torch.randn(4, 1, 4)
    cu64, cu32 = torch.tensor([0, 4, 9]), torch.tensor([0, 4, 9], dtype=torch.int32)
    state = torch.randn(2, 4, 3)
    a = short_conv(x, w, state=state, cu_seqlens=cu64, output_final_state=True)
    b = short_conv(x, w, state=state, cu_seqlens=cu32, output_final_state=True)
    torch.testing.assert_close(a, b)
    empty = torch.tensor([0, 0, 0])
    y, s = short_conv(torch.randn(1, 0, 4), w, state=state, cu_seqlens=empty, output_final_state=True)
    assert y.shape == (1, 0, 4) and torch.equal(s, state)


def test_the_fla_backend_refuses_cpu_tensors_and_unknown_backends_by_name():
    x, w = torch.randn(1, 8, 16), torch.randn(16, 1, 4)
    with pytest.raises(RuntimeError, match="CUDA tensors"):
        short_conv(x, w, backend="fla")
    with pytest.raises(ValueError, match="unknown KDA backend 'cuda'"):
        short_conv(x, w, backend="cuda")
    y, _ = short_conv(x, w, backend="torch")
    assert torch.equal(y, short_conv(x, w)[0])  # "auto" on CPU is the reference


needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")
DEV = "cuda" if torch.cuda.is_available() else "cpu"


@needs_triton
@pytest.mark.parametrize("W", [1, 2, 4])
@pytest.mark.parametrize("layout", ["packed", "rows", "one"])
def test_triton_kernels_equal_the_reference_with_gradients(W, layout):
    """k3's Triton kernels (training's stateless conv without activation; Triton's interpreter on CPU) equal the
    reference (both summing in fp32) in output and in the gradients of x and the weight: packed documents shorter than W, empty and longer
    than a time tile, a batch of rows (each its own document), one row; T and the channels not multiples of the
    tiles; x a view into a wider row (``stateless_inputs``'s layout)."""
    from k3.ops.short_conv import _triton

    D, T = 150, 140
    cu = {"packed": torch.tensor([0, 1, 3, 3, 70, 139, 140]), "rows": None, "one": None}[layout]
    B = 2 if layout == "rows" else 1
    wide = torch.randn(B, T, D + 17, device=DEV)
    x = wide[..., 5:5 + D].requires_grad_()
    w = torch.randn(D, 1, W, device=DEV, requires_grad=True)
    cu_dev = cu.to(DEV) if cu is not None else None
    y = _triton(x, w, cu_dev)
    gy = torch.randn_like(y)
    dx, dw = torch.autograd.grad((y * gy).sum(), [x, w])
    y_ref = short_conv(x, w, cu_seqlens=cu_dev, activation=False, backend="torch")[0]
    dx_ref, dw_ref = torch.autograd.grad((y_ref * gy).sum(), [x, w])
    torch.testing.assert_close(y, y_ref)
    torch.testing.assert_close(dx, dx_ref)
    torch.testing.assert_close(dw, dw_ref)


@needs_triton
def test_triton_kernels_in_bf16_sum_in_fp32():
    """bf16 x, fp32 weight (autocast's layout): the output and x's gradient are the fp32 sums rounded once, the
    weight's gradient the fp32 sum over every token."""
    from k3.ops.short_conv import _triton

    cu = torch.tensor([0, 90, 200], device=DEV)
    x = torch.randn(1, 200, 64, device=DEV).bfloat16().requires_grad_()
    w = torch.randn(64, 1, 4, device=DEV, requires_grad=True)
    y = _triton(x, w, cu)
    gy = torch.randn_like(y)
    dx, dw = torch.autograd.grad((y.float() * gy.float()).sum(), [x, w])
    xr = x.detach().float().requires_grad_()
    y_ref = short_conv(xr, w, cu_seqlens=cu, activation=False, backend="torch")[0]
    dx_ref, dw_ref = torch.autograd.grad((y_ref * gy.float()).sum(), [xr, w])
    assert y.dtype == dx.dtype == torch.bfloat16 and dw.dtype == torch.float32
    torch.testing.assert_close(y.float(), y_ref.bfloat16().float(), atol=0, rtol=0.01)
    torch.testing.assert_close(dx.float(), dx_ref.bfloat16().float(), atol=0, rtol=0.01)
    torch.testing.assert_close(dw, dw_ref, atol=1e-3, rtol=1e-4)
    with pytest.raises(ValueError, match="covers 200 tokens; x has 199"):
        _triton(x[:, :199], w, cu)
