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
