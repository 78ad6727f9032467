import pytest
import torch
import torch.nn.functional as F

from k3.ops import kda as kda_ops
from k3.ops.kda.gate import lower_bound_gate, softplus_gate
from k3.ops.kda.reference import chunk_kda, recurrent_kda
from tests.conftest import assert_close


def make_inputs(B, T, H, K, V, dtype=torch.float32, gate_lo=-5.0, gate_hi=0.0):
    q = torch.randn(B, T, H, K, dtype=dtype)
    k = F.normalize(torch.randn(B, T, H, K, dtype=dtype), dim=-1)
    v = torch.randn(B, T, H, V, dtype=dtype)
    g = gate_lo + (gate_hi - gate_lo) * torch.rand(B, T, H, K, dtype=dtype)  # spans (-5, 0)
    beta = torch.rand(B, T, H, dtype=dtype)
    return q, k, v, g, beta


def explicit_matrix_kda(q, k, v, g, beta, h0):
    """Independent ground truth: S_t = (I - b k k^T) Diag(alpha_t) S_{t-1} + b k v^T, o_t = S_t^T q_t / sqrt(K)."""
    B, T, H, K = q.shape
    S = h0.clone()
    out = []
    eye = torch.eye(K, dtype=q.dtype)
    for t in range(T):
        kt, bt = k[:, t], beta[:, t]
        P = eye - bt[..., None, None] * kt[..., :, None] * kt[..., None, :]
        S = P @ (torch.diag_embed(g[:, t].exp()) @ S) + bt[..., None, None] * kt[..., :, None] * v[:, t][..., None, :]
        out.append((S.transpose(-1, -2) @ q[:, t][..., None]).squeeze(-1) * K**-0.5)
    return torch.stack(out, 1), S


def test_recurrent_matches_explicit_matrix_form():
    q, k, v, g, beta = make_inputs(2, 12, 2, 8, 4, torch.float64)
    h0 = torch.randn(2, 2, 8, 4, dtype=torch.float64)
    o, s = recurrent_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    o_ref, s_ref = explicit_matrix_kda(q, k, v, g, beta, h0)
    torch.testing.assert_close(o, o_ref)
    torch.testing.assert_close(s, s_ref)


@pytest.mark.slow
@pytest.mark.parametrize("B,T,H,K,V,chunk", [(2, 100, 3, 16, 8, 64), (1, 64, 2, 32, 32, 64), (2, 37, 2, 16, 16, 16),
                                             (1, 200, 2, 8, 16, 32)])
@pytest.mark.parametrize("with_h0", [False, True])
@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-9), (torch.float32, 1e-3)], ids=["fp64", "fp32"])
def test_chunk_matches_recurrent_outputs_states_and_grads(B, T, H, K, V, chunk, with_h0, dtype, tol):
    inputs = [x.requires_grad_() for x in make_inputs(B, T, H, K, V, dtype)]
    h0 = torch.randn(B, H, K, V, dtype=dtype, requires_grad=True) if with_h0 else None
    do, ds = torch.randn(B, T, H, V, dtype=dtype), torch.randn(B, H, K, V, dtype=dtype)
    grads = {}
    for name, fn in (("rec", recurrent_kda), ("chunk", lambda *a, **kw: chunk_kda(*a, chunk_size=chunk, **kw))):
        o, s = fn(*inputs, initial_state=h0, output_final_state=True)
        ((o * do).sum() + (s * ds).sum()).backward()
        grads[name] = (o, s, *[x.grad.clone() for x in inputs], h0.grad.clone() if with_h0 else None)
        for x in inputs + ([h0] if with_h0 else []):
            x.grad = None
    names = ["o", "state", "dq", "dk", "dv", "dg", "dbeta", "dh0"]
    for n, a, b in zip(names, grads["rec"], grads["chunk"]):
        if a is not None:
            assert_close(n, a, b, tol)


def test_packed_documents_reset_state_and_match_separate_calls():
    q, k, v, g, beta = [x.requires_grad_() for x in make_inputs(1, 150, 2, 16, 8)]
    cu = torch.tensor([0, 17, 80, 81, 150])
    h0 = torch.randn(4, 2, 16, 8)
    o, s = chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu)
    o_rec, s_rec = recurrent_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu)
    assert_close("o packed", o_rec, o, 5e-4)
    assert_close("s packed", s_rec, s, 5e-4)
    for n in range(4):
        a, b = cu[n], cu[n + 1]
        o_n, s_n = recurrent_kda(*(x[:, a:b] for x in (q, k, v, g, beta)), initial_state=h0[n:n + 1],
                                 output_final_state=True)
        assert_close(f"doc {n} o", o_n, o[:, a:b], 5e-4)
        assert_close(f"doc {n} state", s_n, s[n:n + 1], 5e-4)
    # gradients of the packed chunk call equal the packed recurrence's
    do = torch.randn_like(o)
    gc = torch.autograd.grad((o * do).sum(), (q, k, v, g, beta))
    gr = torch.autograd.grad((o_rec * do).sum(), (q, k, v, g, beta))
    for n, a, b in zip("qkvgb", gr, gc):
        assert_close(f"packed d{n}", a, b, 5e-4)


@pytest.mark.parametrize("with_states", [False, True], ids=["training", "states-in-and-out"])
@pytest.mark.parametrize("gate_lo", [-0.05, -5.0, -60.0], ids=["long-memory", "gate-floor", "unbounded-gate"])
def test_packed_chunk_by_length_groups_matches_the_recurrence(gate_lo, with_states):
    """Packed documents run in length groups (several here: a 5-chunk document, 3- and 4-chunk ones, short
    ones, an empty one, one on a chunk boundary, one ending the row mid-chunk): outputs, final states (an empty
    document's is its initial state) and every gradient equal the packed recurrence. Gates near 0 keep states
    alive for 100s of tokens, so a state leaking between documents or groups shows; gates down to -60 run the
    diagonal tiles' masked-exponent branch."""
    torch.manual_seed(0)
    q, k, v, g, beta = [x.requires_grad_() for x in make_inputs(1, 203, 2, 8, 6, torch.float64, gate_lo=gate_lo)]
    cu = torch.tensor([0, 5, 64, 64, 100, 128, 200, 203])
    h0 = torch.randn(7, 2, 8, 6, dtype=torch.float64, requires_grad=True) if with_states else None
    kw = dict(initial_state=h0, output_final_state=with_states, cu_seqlens=cu)
    o, s = chunk_kda(q, k, v, g, beta, chunk_size=16, tile=4, **kw)
    o_rec, s_rec = recurrent_kda(q, k, v, g, beta, **kw)
    assert_close("o", o_rec, o, 1e-12)
    if with_states:
        assert_close("final states", s_rec, s, 1e-12)
        torch.testing.assert_close(s[2], h0[2])  # the empty document
    do = torch.randn_like(o)
    loss_c, loss_r = (o * do).sum(), (o_rec * do).sum()
    leaves = (q, k, v, g, beta) + ((h0,) if with_states else ())
    if with_states:
        ds = torch.randn_like(s)
        loss_c, loss_r = loss_c + (s * ds).sum(), loss_r + (s_rec * ds).sum()
    gc, gr = torch.autograd.grad(loss_c, leaves), torch.autograd.grad(loss_r, leaves)
    for n, a, b in zip(["dq", "dk", "dv", "dg", "dbeta", "dh0"], gr, gc):
        assert_close(n, a, b, 1e-12)


@pytest.mark.slow
def test_gradcheck_float64_chunk_packed():
    q, k, v, g, beta = [x.requires_grad_() for x in make_inputs(1, 13, 1, 3, 2, torch.float64)]
    cu = torch.tensor([0, 3, 11, 13])  # a document across the chunk boundary at 8, one ending the row mid-chunk
    assert torch.autograd.gradcheck(lambda *a: chunk_kda(*a, cu_seqlens=cu, chunk_size=8, tile=4)[0],
                                    (q, k, v, g, beta))


@pytest.mark.slow
def test_gradcheck_float64_chunk():
    q, k, v, g, beta = [x.requires_grad_() for x in make_inputs(1, 11, 1, 4, 3, torch.float64)]
    h0 = torch.randn(1, 1, 4, 3, dtype=torch.float64, requires_grad=True)

    def f(q, k, v, g, beta, h0):
        o, s = chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True, chunk_size=8, tile=4)
        return o, s

    assert torch.autograd.gradcheck(f, (q, k, v, g, beta, h0))


def test_gradcheck_float64_recurrent_packed():
    q, k, v, g, beta = [x.requires_grad_() for x in make_inputs(1, 7, 1, 3, 2, torch.float64)]
    cu = torch.tensor([0, 3, 7])
    assert torch.autograd.gradcheck(lambda *a: recurrent_kda(*a, cu_seqlens=cu)[0], (q, k, v, g, beta))


@pytest.mark.slow
@pytest.mark.parametrize("g_value", [-5.0, -4.999, -20.0])
def test_chunk_grads_finite_at_the_gate_floor_and_below(g_value):
    """fla's naive chunk multiplies 0 * inf in backward for gates near -5; ours never forms exp(+x)."""
    q, k, v, _, beta = make_inputs(1, 128, 2, 32, 16)
    g = torch.full((1, 128, 2, 32), g_value, requires_grad=True)
    xs = [x.requires_grad_() for x in (q, k, v, beta)]
    o, s = chunk_kda(xs[0], xs[1], xs[2], g, xs[3], output_final_state=True)
    (o.sum() + s.sum()).backward()
    for t in xs + [g]:
        assert torch.isfinite(t.grad).all()
    o_ref, _ = recurrent_kda(q, k, v, g.detach(), beta)
    assert_close("o at floor", o_ref, o, 5e-4)


def test_bf16_inputs_computed_in_fp32():
    q, k, v, g, beta = make_inputs(1, 64, 2, 16, 16)
    o32, _ = chunk_kda(q, k, v, g, beta)
    o16, _ = chunk_kda(q.bfloat16(), k.bfloat16(), v.bfloat16(), g, beta)
    assert o16.dtype == torch.bfloat16
    assert_close("bf16", o32, o16, 0.05)


def test_gates():
    z = torch.randn(2, 5, 3, 4) * 3
    A_log, dt = torch.randn(3), torch.randn(12)
    g = lower_bound_gate(z, A_log, dt, -5.0)
    assert (g >= -5).all() and (g <= 0).all() and g.min() < -4 and g.max() > -1
    ref = -5 * torch.sigmoid(A_log.exp().view(3, 1) * (z + dt.view(3, 4)))
    torch.testing.assert_close(g, ref)
    gs = softplus_gate(z, A_log, dt)
    torch.testing.assert_close(gs, -A_log.exp().view(3, 1) * F.softplus(z + dt.view(3, 4)))
    with pytest.raises(ValueError, match="one entry per head"):
        lower_bound_gate(z, torch.zeros(4), dt)


def test_input_validation_names_the_problem():
    q, k, v, g, beta = make_inputs(2, 8, 2, 4, 4)
    with pytest.raises(ValueError, match="beta must be"):
        chunk_kda(q, k, v, g, beta[..., :1])
    with pytest.raises(ValueError, match="batch 1"):
        chunk_kda(q, k, v, g, beta, cu_seqlens=torch.tensor([0, 8]))
    with pytest.raises(ValueError, match="initial_state"):
        chunk_kda(q, k, v, g, beta, initial_state=torch.zeros(1, 2, 4, 4))


def test_backend_dispatch_on_cpu():
    q, k, v, g, beta = make_inputs(1, 16, 1, 4, 4)
    assert kda_ops.resolve_backend("auto", q) == "torch"
    o, _ = kda_ops.chunk_kda(q, k, v, g, beta, backend="auto")
    torch.testing.assert_close(o, chunk_kda(q, k, v, g, beta)[0])
    with pytest.raises(RuntimeError, match="fla-core"):
        kda_ops.chunk_kda(q, k, v, g, beta, backend="fla")
    with pytest.raises(ValueError, match="unknown KDA backend"):
        kda_ops.chunk_kda(q, k, v, g, beta, backend="triton")
