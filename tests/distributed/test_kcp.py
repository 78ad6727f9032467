"""KCP and intra-device CP (SPEC §8) against single-process chunk_kda / short_conv: outputs, states, gradients.

Multi-process tests spawn 2 or 4 ranks (gloo on CPU, or NCCL on cuda:rank with K3_TEST_BACKEND=nccl); each rank
builds the same global inputs from one seed, runs the single-process reference on the whole sequence, and checks
its own slice of outputs and input gradients.
Legend: B batch, T time, H heads, K key dim, V value dim, D channels, W conv width.
"""


import pytest
import torch
import torch.distributed as dist

from k3.distributed.kcp import kcp_chunk_kda, kcp_short_conv, local_cu_seqlens
from k3.ops.kda.cp import apply_initial_state, intra_device_cp_kda, scan_states, segment_outputs, segment_summary
from k3.ops.kda.reference import chunk_kda, recurrent_kda
from k3.ops.short_conv import short_conv

from .gloo import spawn, worlds
from tests.conftest import assert_close
from tests.ops.test_kda import make_inputs

H, K, V, C = 2, 8, 6, 16  # C: chunk size, small so that every segment spans several chunks
LENS = {2: [72, 56], 4: [40, 72, 56, 64]}  # tokens per rank, deliberately uneven
# packed layouts (global cu_seqlens): documents crossing 1, 2 and 3 rank boundaries, documents starting exactly at
# a rank's first token (on the last rank and on a middle one), ranks whose last piece is shorter than the conv halo
LAYOUTS = {2: [[0, 30, 70, 128], [0, 72, 100, 128]],
           4: [[0, 25, 110, 168, 232], [0, 38, 190, 232], [0, 25, 112, 200, 232]]}


def long_memory_inputs(B, T, dtype=torch.float64):
    """Gates in (-0.02, 0) and beta in (0, 0.2): a segment's transition M keeps a norm ~0.3 over 70 tokens, so the
    carried state (and every cross-segment gradient) matters. With gates in (-5, 0), M ~ 1e-59 and a wrong scan or
    adjoint would pass unnoticed."""
    q, k, v, g, beta = make_inputs(B, T, H, K, V, dtype, gate_lo=-0.02)
    return q, k, v, g, 0.2 * beta


def run_kda(fn, inputs, h0, do, ds, **kw):
    """(o, final, grads of inputs and h0) for loss = <o, do> + <final, ds>."""
    xs = [x.clone().requires_grad_() for x in inputs]
    h = h0.clone().requires_grad_() if h0 is not None else None
    o, s = fn(*xs, initial_state=h, output_final_state=True, **kw)
    ((o * do).sum() + (s * ds).sum()).backward()
    return o, s, [x.grad for x in xs] + ([h.grad] if h is not None else [])


# ---------------------------------------------------------------- single process


def test_segment_summary_is_the_affine_map_of_the_recurrence():
    q, k, v, g, beta = long_memory_inputs(2, 45)
    S_in = torch.randn(2, H, K, V, dtype=torch.float64)
    M, S_loc = segment_summary(k, v, g, beta, chunk_size=C)
    _, S_out = recurrent_kda(q, k, v, g, beta, initial_state=S_in, output_final_state=True)
    assert_close("M S_in + S~", S_out, M @ S_in + S_loc, 1e-12)
    # M = A_T ... A_1, the explicit product of (I - b k k^T) Diag(exp g) (later factors on the left)
    M_ref = torch.eye(K, dtype=torch.float64).expand(2, H, K, K)
    for t in range(45):
        kt, bt = k[:, t], beta[:, t, :, None, None]
        A = (torch.eye(K, dtype=torch.float64) - bt * kt[..., :, None] * kt[..., None, :]) @ torch.diag_embed(g[:, t].exp())
        M_ref = A @ M_ref
    assert_close("M explicit", M_ref, M, 1e-12)
    _, S_zero = recurrent_kda(q, k, v, g, beta, output_final_state=True)
    assert_close("S~ zero start", S_zero, S_loc, 1e-12)


def test_one_pass_segment_outputs_from_any_initial_state():
    """segment_outputs + apply_initial_state (what KCP and intra-device CP run) equal chunk_kda from that initial
    state: outputs, final state and the gradients of every input and of the state, in one pass."""
    inputs = long_memory_inputs(2, 45)
    S_in = torch.randn(2, H, K, V, dtype=torch.float64)
    do, ds = torch.randn(2, 45, H, V, dtype=torch.float64), torch.randn(2, H, K, V, dtype=torch.float64)

    def one_pass(q, k, v, g, beta, initial_state, output_final_state, scale=0.3):
        o_zero, P, M, S_loc = segment_outputs(q, k, v, g, beta, scale, chunk_size=C)
        return apply_initial_state(o_zero, P, initial_state), S_loc + M @ initial_state

    ref = run_kda(chunk_kda, inputs, S_in, do, ds, scale=0.3, chunk_size=C)
    got = run_kda(one_pass, inputs, S_in, do, ds)
    for name, a, b in zip(["o", "final", "dq", "dk", "dv", "dg", "dbeta", "dS_in"], [*ref[:2], *ref[2]], [*got[:2], *got[2]]):
        assert_close(name, a, b, 1e-12)
    o_zero, P, _, _ = segment_outputs(*(x.float() for x in inputs), chunk_size=C)
    assert apply_initial_state(o_zero.bfloat16(), P.bfloat16(), S_in.float()).dtype == torch.bfloat16


def test_scan_states_gives_the_state_at_every_segment_boundary():
    q, k, v, g, beta = long_memory_inputs(1, 90)
    S0 = torch.randn(1, H, K, V, dtype=torch.float64)
    cuts = [0, 20, 21, 64, 90]
    summaries = [segment_summary(*(x[:, a:b] for x in (k, v, g, beta)), chunk_size=C) for a, b in zip(cuts, cuts[1:])]
    states = scan_states([m for m, _ in summaries], [s for _, s in summaries], S0)
    assert len(states) == len(cuts)
    for t, S in zip(cuts, states):
        _, S_ref = recurrent_kda(*(x[:, :t] for x in (q, k, v, g, beta)), initial_state=S0, output_final_state=True)
        assert_close(f"S_in at {t}", S_ref, S, 1e-12)
    with pytest.raises(ValueError, match="one transition per local state"):
        scan_states([], [])


@pytest.mark.parametrize("T,R", [(128, 1), (128, 2), (100, 3), (129, 4), (50, 7)], ids=lambda x: str(x))
@pytest.mark.parametrize("with_h0", [False, True])
def test_intra_device_cp_equals_chunk_kda(T, R, with_h0):
    inputs = long_memory_inputs(2, T)
    h0 = torch.randn(2, H, K, V, dtype=torch.float64) if with_h0 else None
    do, ds = torch.randn(2, T, H, V, dtype=torch.float64), torch.randn(2, H, K, V, dtype=torch.float64)
    ref = run_kda(chunk_kda, inputs, h0, do, ds, chunk_size=C)
    cp = run_kda(intra_device_cp_kda, inputs, h0, do, ds, num_segments=R, chunk_size=C)
    names = ["o", "final", "dq", "dk", "dv", "dg", "dbeta", "dh0"]
    for name, a, b in zip(names, [ref[0], ref[1], *ref[2]], [cp[0], cp[1], *cp[2]]):
        assert_close(name, a, b, 1e-9)


def test_intra_device_cp_fp32_and_bf16():
    q, k, v, g, beta = make_inputs(1, 256, H, 16, 16)
    o_ref, s_ref = chunk_kda(q, k, v, g, beta, output_final_state=True)
    o, s = intra_device_cp_kda(q, k, v, g, beta, 4, output_final_state=True)
    assert_close("fp32 o", o_ref, o, 1e-5)
    assert_close("fp32 final", s_ref, s, 1e-5)
    o16, _ = intra_device_cp_kda(q.bfloat16(), k.bfloat16(), v.bfloat16(), g, beta, 4)
    assert o16.dtype == torch.bfloat16
    assert_close("bf16 o", o_ref, o16, 0.05)


def test_local_cu_seqlens():
    cu = torch.tensor([0, 25, 110, 168, 232])
    assert [(c.tolist(), f) for c, f in (local_cu_seqlens(cu, a, b) for a, b in
                                         [(0, 40), (40, 112), (112, 168), (168, 232)])] == [
        ([0, 25, 40], False), ([0, 70, 72], True), ([0, 56], True), ([0, 64], False)]
    with pytest.raises(ValueError, match="non-empty part"):
        local_cu_seqlens(cu, 40, 40)


def test_kcp_input_errors_are_raised_before_any_collective():
    q, k, v, g, beta = make_inputs(1, 8, H, K, V)
    with pytest.raises(ValueError, match="non-empty"):
        kcp_chunk_kda(q, k, v, g, beta, cu_seqlens=torch.tensor([0, 0, 8]))
    with pytest.raises(ValueError, match="LOCAL to this rank"):
        kcp_chunk_kda(q, k, v, g, beta, cu_seqlens=torch.tensor([0, 4, 16]))
    with pytest.raises(ValueError, match="batch 1"):
        kcp_chunk_kda(*make_inputs(2, 8, H, K, V), cu_seqlens=torch.tensor([0, 8]))
    with pytest.raises(ValueError, match="at least W-1"):
        kcp_short_conv(torch.randn(1, 2, 4), torch.randn(4, 1, 4))


# ---------------------------------------------------------------- multi-process (gloo, or NCCL: see gloo.py)


def _rank_range(rank, world):
    lens = LENS[world]
    return sum(lens[:rank]), sum(lens[:rank + 1]), sum(lens)


def _chunk_kda_last_state(*args, **kw):
    o, s = chunk_kda(*args, **kw)
    return o, s[-1:]


def _check_kcp_kda(rank, world, packed):
    start, end, T = _rank_range(rank, world)
    for layout in LAYOUTS[world] if packed else [None]:
        torch.manual_seed(1)
        B = 1 if packed else 2
        inputs = long_memory_inputs(B, T)
        do, ds = torch.randn(B, T, H, V, dtype=torch.float64), torch.randn(1, H, K, V, dtype=torch.float64)
        cu = torch.tensor(layout) if packed else None
        # single process, whole sequence; the last sequence's (or document's) final state enters the loss
        o_ref, s_ref, g_ref = run_kda(_chunk_kda_last_state, inputs, None, do, ds, cu_seqlens=cu, chunk_size=C)
        cu_loc, continues = local_cu_seqlens(cu, start, end) if packed else (None, True)
        xs = [x[:, start:end].clone().requires_grad_() for x in inputs]
        o, s = kcp_chunk_kda(*xs, cu_seqlens=cu_loc, first_doc_continues=continues, output_final_state=True,
                             chunk_size=C)
        loss = (o * do[:, start:end]).sum()
        if rank == world - 1:
            loss = loss + (s[-1:] * ds).sum()
            assert_close(f"rank {rank} final state", s_ref, s[-1:], 1e-9)
        loss.backward()
        assert_close(f"rank {rank} o {layout}", o_ref[:, start:end], o, 1e-9)
        for name, a, x in zip(["dq", "dk", "dv", "dg", "dbeta"], g_ref, xs):
            assert_close(f"rank {rank} {name} {layout}", a[:, start:end], x.grad, 1e-9)


def _check_kcp_short_conv(rank, world):
    start, end, T = _rank_range(rank, world)
    D, W = 6, 4
    for layout in [None] + LAYOUTS[world]:
        torch.manual_seed(2)
        B = 2 if layout is None else 1
        x, w = torch.randn(B, T, D, dtype=torch.float64), torch.randn(D, 1, W, dtype=torch.float64)
        dy = torch.randn(B, T, D, dtype=torch.float64)
        cu = None if layout is None else torch.tensor(layout)
        x_ref, w_ref = x.clone().requires_grad_(), w.clone().requires_grad_()
        y_ref, _ = short_conv(x_ref, w_ref, cu_seqlens=cu)
        (y_ref * dy).sum().backward()
        cu_loc, continues = local_cu_seqlens(cu, start, end) if cu is not None else (None, True)
        xl, wl = x[:, start:end].clone().requires_grad_(), w.clone().requires_grad_()
        y = kcp_short_conv(xl, wl, cu_seqlens=cu_loc, first_doc_continues=continues)
        (y * dy[:, start:end]).sum().backward()
        dist.all_reduce(wl.grad)  # the weight is replicated: its gradient is the sum over ranks
        assert_close(f"rank {rank} y {layout}", y_ref[:, start:end], y, 1e-12)
        assert_close(f"rank {rank} dx {layout}", x_ref.grad[:, start:end], xl.grad, 1e-12)
        assert_close(f"rank {rank} dw {layout}", w_ref.grad, wl.grad, 1e-12)


def _check_all(rank, world):
    _check_kcp_kda(rank, world, packed=False)
    _check_kcp_kda(rank, world, packed=True)
    _check_kcp_short_conv(rank, world)


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("world", worlds(2, 4))
def test_kcp_kda_and_short_conv_match_single_process(world, tmp_path):
    """One spawn per world size (process start-up dominates): KCP chunk_kda on plain batches and on packed
    documents (every layout of LAYOUTS), then kcp_short_conv on both; outputs, final state, all input gradients."""
    spawn(_check_all, world, tmp_path)
