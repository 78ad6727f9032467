import pytest
import torch

from k3.ops.routing import router_scores, select_experts


def test_bias_changes_choice_never_weights_of_chosen():
    scores = router_scores(torch.randn(64, 16))
    w0, i0 = select_experts(scores, None, 4)
    bias = torch.zeros(16)
    bias[3] = 5.0  # force expert 3 into every token's top-4
    w1, i1 = select_experts(scores, bias, 4)
    assert (i1 == 3).any(-1).all() and not (i0 == 3).any(-1).all()
    # weights are the chosen experts' own (unbiased) scores, renormalised over the chosen set
    chosen = scores.gather(-1, i1)
    torch.testing.assert_close(w1, chosen / chosen.sum(-1, keepdim=True))
    # for a token whose choice did not change, its weights are identical with or without the bias
    same = (i0.sort(-1).values == i1.sort(-1).values).all(-1)
    assert same.any()
    w0s = w0.gather(-1, i0.argsort(-1)).gather(-1, i0.sort(-1).values.argsort(-1).argsort(-1))
    for t in torch.nonzero(same).flatten():
        a = dict(zip(i0[t].tolist(), w0[t].tolist()))
        b = dict(zip(i1[t].tolist(), w1[t].tolist()))
        assert a.keys() == b.keys() and all(abs(a[e] - b[e]) < 1e-6 for e in a)
    del w0s


def test_bias_carries_no_gradient_and_scaling_applies():
    logits = torch.randn(8, 6, requires_grad=True)
    bias = torch.randn(6, requires_grad=True)
    w, _ = select_experts(router_scores(logits), bias, 2, scaling=2.5)
    torch.testing.assert_close(w.sum(-1), torch.full((8,), 2.5))
    w.pow(2).sum().backward()
    assert bias.grad is None and logits.grad is not None


def test_bincount_equals_torch_bincount_and_rejects_values_out_of_range():
    from k3.ops.routing import bincount

    g = torch.Generator().manual_seed(0)
    for shape, n in [((7, 4), 9), ((0,), 3), ((100,), 1)]:
        x = torch.randint(0, n, shape, generator=g)
        assert torch.equal(bincount(x, n), torch.bincount(x.flatten(), minlength=n))
        assert bincount(x, n).dtype == torch.int64
    with pytest.raises((IndexError, RuntimeError)):
        bincount(torch.tensor([0, 3]), 3)


@pytest.mark.parametrize("k", [1, 3, 8])
def test_dispatch_and_combine_equal_indexing_and_index_add_with_their_gradients(k):
    """dispatch_rows / combine_rows are z[order // k] and index_add_ over tokens; their gradients, gathers through
    the inverse permutation, equal autograd's scatter-adds of the plain forms (and pass gradcheck)."""
    from k3.ops.routing import combine_rows, dispatch_rows, inverse_permutation

    torch.manual_seed(0)
    N, L = 7, 5
    order = torch.randperm(N * k)
    inverse = inverse_permutation(order)
    assert torch.equal(order[inverse], torch.arange(N * k)) and torch.equal(inverse[order], torch.arange(N * k))
    z = torch.randn(N, L, dtype=torch.float64, requires_grad=True)
    rows = torch.randn(N * k, L, dtype=torch.float64, requires_grad=True)
    g_rows, g_out = torch.randn(N * k, L, dtype=torch.float64), torch.randn(N, L, dtype=torch.float64)
    ours = dispatch_rows(z, order, inverse, k)
    plain = z[order // k]
    torch.testing.assert_close(ours, plain)
    torch.testing.assert_close(torch.autograd.grad(ours, z, g_rows)[0], torch.autograd.grad(plain, z, g_rows)[0])
    ours = combine_rows(rows, order, inverse, k)
    plain = torch.zeros(N, L, dtype=torch.float64).index_add_(0, order // k, rows)
    torch.testing.assert_close(ours, plain)
    torch.testing.assert_close(torch.autograd.grad(ours, rows, g_out)[0], torch.autograd.grad(plain, rows, g_out)[0])
    assert torch.autograd.gradcheck(lambda x: dispatch_rows(x, order, inverse, k), (z,))
    assert torch.autograd.gradcheck(lambda x: combine_rows(x, order, inverse, k), (rows,))
    # bf16 rows: the combine sums in fp32 and returns fp32; the dispatch's gradient comes back in z's dtype
    zb = z.detach().bfloat16().requires_grad_()
    assert combine_rows(rows.detach().bfloat16(), order, inverse, k).dtype == torch.float32
    dispatch_rows(zb, order, inverse, k).float().sum().backward()
    assert zb.grad.dtype == torch.bfloat16 and torch.equal(zb.grad, torch.full((N, L), float(k), dtype=torch.bfloat16))
