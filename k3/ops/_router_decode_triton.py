"""Triton kernel of ``k3.ops.router_decode`` (imported only when Triton is there). See that module for the math.

Legend: N tokens, D hidden (BLOCK_D per step), E experts (BLOCK_E per program), k experts per token.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._arrivals import arrival_counters


@triton.jit
def _router_kernel(X, W, BIAS, S, SB, WOUT, IOUT, COUNT, D, E, SCALING, NPROG: tl.constexpr, K_TOP: tl.constexpr,
                   K_POW2: tl.constexpr, RENORM: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_D: tl.constexpr,
                   BLOCK_ALL: tl.constexpr):
    """Program (n, j): scores[n, e] = sigmoid(x_n . w_e) in fp32 and the biased scores that choose the experts, for
    the j-th block of BLOCK_E experts. The last of row n's NPROG programs to arrive (``k3.ops._arrivals``) then
    takes the k largest biased scores of the row by k passes of max (the lowest index wins a tie); their unbiased
    scores are the weights, renormalised to sum 1 (RENORM) and scaled."""
    n = tl.program_id(0)
    offs_e = tl.program_id(1) * BLOCK_E + tl.arange(0, BLOCK_E)
    me = offs_e < E
    acc = tl.zeros([BLOCK_E], tl.float32)
    for d0 in range(0, D, BLOCK_D):
        offs_d = d0 + tl.arange(0, BLOCK_D)
        md = offs_d < D
        x = tl.load(X + n * D + offs_d, mask=md, other=0.0).to(tl.float32)
        w = tl.load(W + offs_e[:, None] * D + offs_d[None, :], mask=me[:, None] & md[None, :], other=0.0)
        acc += tl.sum(w.to(tl.float32) * x[None, :], 1)
    s = tl.sigmoid(acc)
    tl.store(S + n * E + offs_e, s, mask=me)
    tl.store(SB + n * E + offs_e, s + tl.load(BIAS + offs_e, mask=me, other=0.0).to(tl.float32), mask=me)
    tl.debug_barrier()  # every thread's stores of this block are done before the arrival is counted
    arrived = tl.atomic_add(COUNT + n, 1, sem="acq_rel")
    if arrived == NPROG - 1:  # the last of the row: every block of scores is written
        offs = tl.arange(0, BLOCK_ALL)
        offs_k = tl.arange(0, K_POW2)
        # ".cg": from L2, where the other programs' stores are, never a stale L1 line
        biased = tl.load(SB + n * E + offs, mask=offs < E, other=float("-inf"), cache_modifier=".cg")
        scores = tl.load(S + n * E + offs, mask=offs < E, other=0.0, cache_modifier=".cg")
        wk = tl.zeros([K_POW2], tl.float32)
        for j in tl.static_range(K_TOP):
            e = tl.min(tl.where(biased == tl.max(biased, 0), offs, BLOCK_ALL), 0)
            tl.store(IOUT + n * K_TOP + j, e.to(tl.int64))
            wk = tl.where(offs_k == j, tl.sum(tl.where(offs == e, scores, 0.0), 0), wk)
            biased = tl.where(offs == e, float("-inf"), biased)
        if RENORM:
            wk = wk / (tl.sum(wk, 0) + 1e-20)
        tl.store(WOUT + n * K_TOP + offs_k, wk * SCALING, mask=offs_k < K_TOP)
        tl.atomic_xchg(COUNT + n, 0, sem="relaxed")


def router_decode_kernels(x, weight, bias, k: int, renormalize: bool, scaling: float):
    N, D = x.shape
    E = weight.shape[0]
    scores = torch.empty(N, E, dtype=torch.float32, device=x.device)
    biased = torch.empty_like(scores)
    w = torch.empty(N, k, dtype=torch.float32, device=x.device)
    idx = torch.empty(N, k, dtype=torch.int64, device=x.device)
    # latency-bound at a few tokens: many small programs (4 experts each), each reading its rows of W in one load
    # for D <= 1024 (a loop of dependent loads was 6 us per layer on the H200 with 16 experts x 256 per step); the
    # top-k in the row's last program, not a second launch
    block_e = min(4, triton.next_power_of_2(E))
    nprog = triton.cdiv(E, block_e)
    count = arrival_counters(x.device, N, "router_decode")
    _router_kernel[(N, nprog)](x, weight, bias, scores, biased, w, idx, count, D, E, float(scaling), NPROG=nprog,
                               K_TOP=k, K_POW2=triton.next_power_of_2(k), RENORM=renormalize, BLOCK_E=block_e,
                               BLOCK_D=min(1024, triton.next_power_of_2(D)),
                               BLOCK_ALL=triton.next_power_of_2(E), num_warps=4)
    return w, idx, scores
