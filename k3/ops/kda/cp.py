"""Context parallelism for KDA inside one process (SPEC §8): segment summaries, the prefix scan, intra-device CP.

Legend: B batch, T time, H heads, K key dim, V value dim, R segments, L segment length. States are fp32
(fp64 when the inputs are fp64), S [.., K, V] and M [.., K, K], as everywhere in ``reference.py``.

A KDA segment is an affine map of the state. With A_t = (I - b_t k_t k_t^T) Diag(exp g_t)  [K,K]:

    S_t = A_t S_{t-1} + b_t k_t v_t^T    =>    S_out = M S_in + S~,    M = A_L ... A_1  (later factors left),
                                                                       S~ = S_out when S_in = 0.

Each column of the state evolves on its own, so M is the final state of the same recurrence started at I with
v = 0, and ONE chunk_kda call with values [v | 0] and initial state [0 | I] returns [S~ | M].

Prefix scan over R segments (forward), S_in(0) = S0 (zeros if None):

    S_in(r+1) = M_r S_in(r) + S~_r                                   r = 0 .. R-1;  S_in(R) = the final state

Its adjoint, with D_r = dL/dS_in(r) from segment r's own outputs and D_R = dL/d(final state):

    lam_R = D_R,   lam_r = D_r + M_r^T lam_{r+1};    dS~_r = lam_{r+1},   dM_r = lam_{r+1} S_in(r)^T,   dS0 = lam_0.

Here autograd derives the adjoint; ``k3.distributed.kcp`` writes it out because its scan crosses ranks.

The same call also gives the segment's outputs for ANY initial state, with no second pass. Its outputs are
[o~ | P]: o~ the outputs from the zero state, P_t = scale q_t^T M_{1:t} [K] (the I columns' outputs), and since
S_t = M_{1:t} S_in + S~_t,

    o_t = o~_t + P_t S_in                                            (one [K] x [K,V] product per token and head)

``segment_outputs`` returns (o~, P, M, S~); ``apply_initial_state`` adds P S_in. fla's kernel costs ~1.1x for
V+K = 256 value columns what it costs for V = 128 (H200, 256K tokens), against 2x for a summary pass plus an
output pass.

Intra-device CP (prefill of one very long sequence): reshape R segments into the batch, run them all at once
through ``segment_outputs``, scan (R tiny matmuls), then add P S_in. Each phase is R-way parallel where a single
chunk_kda walks T/64 chunks in sequence.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from . import chunk_kda as dispatch_chunk_kda
from . import reference, resolve_backend

__all__ = ["segment_summary", "segment_outputs", "apply_initial_state", "scan_states",
           "intra_device_cp_kda", "chunk_kda_any"]


def chunk_kda_any(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False, cu_seqlens=None,
                  chunk_size=64, backend="auto", lower_bound=None):
    """chunk_kda through ``backend`` ("auto": fla-core on CUDA when it imports); ``chunk_size`` reaches the
    reference only (fla's kernels use 64)."""
    if resolve_backend(backend, q) == "fla":
        return dispatch_chunk_kda(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens,
                                  lower_bound=lower_bound, backend="fla")
    return reference.chunk_kda(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens,
                               chunk_size=chunk_size)


def _state_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _identity_states(k: torch.Tensor) -> torch.Tensor:
    B, _, H, K = k.shape
    eye = torch.eye(K, dtype=_state_dtype(k), device=k.device)
    return eye.expand(B, H, K, K).contiguous()  # [B,H,K,K]


def segment_summary(k, v, g, beta, chunk_size=64, backend="auto", lower_bound=None):
    """k, g [B,T,H,K], v [B,T,H,V], beta [B,T,H] -> (M [B,H,K,K], S~ [B,H,K,V]): ``segment_outputs``'s affine map
    alone (values [v | 0] from the initial state [0 | I] end as [S~ | M])."""
    _, _, M, S = segment_outputs(k, k, v, g, beta, 1.0, chunk_size, backend, lower_bound)  # q = k: outputs unused
    return M, S


def segment_outputs(q, k, v, g, beta, scale=None, chunk_size=64, backend="auto", lower_bound=None, cu_seqlens=None,
                    carried=None):
    """q, k, g [B,T,H,K], v [B,T,H,V], beta [B,T,H] -> (o~ [B,T,H,V], P [B,T,H,K], M [N,H,K,K], S~ [N,H,K,V]) in
    ONE chunk_kda call (values [v | 0] from the initial states [0 | I]): o~ the outputs from the zero state, P their
    sensitivity to the initial state (``apply_initial_state``), (M, S~) each sequence's affine map. N = B, or the
    number of packed documents with ``cu_seqlens``. ``carried`` [N] (0/1): which sequences take an initial state
    (the others start from zero: their P and M are 0); default all."""
    B, T, H, K = k.shape
    Vd = v.shape[-1]
    N = B if cu_seqlens is None else cu_seqlens.numel() - 1
    v_cat = torch.cat([v, v.new_zeros(B, T, H, K)], dim=-1)  # [B,T,H,V+K]
    eye = _identity_states(k[:1]).expand(N, H, K, K)
    if carried is not None:
        eye = eye * carried.to(eye)[:, None, None, None]
    h0 = torch.cat([eye.new_zeros(N, H, K, Vd), eye], dim=-1)
    o, S = chunk_kda_any(q, k, v_cat, g, beta, scale, h0.contiguous(), True, cu_seqlens, chunk_size=chunk_size,
                         backend=backend, lower_bound=lower_bound)
    return o[..., :Vd], o[..., Vd:], S[..., Vd:], S[..., :Vd]


def apply_initial_state(o_zero: torch.Tensor, P: torch.Tensor, S_in: torch.Tensor) -> torch.Tensor:
    """o~ [B,T,H,V], P [B,T,H,K] (``segment_outputs``) and an initial state S_in [B,H,K,V] (or [1,H,K,V] for every
    row) -> the outputs from S_in: o~ + P S_in in o~'s dtype. With bf16/fp16 outputs the product runs in that
    dtype (fp32 accumulation), as fla's own output kernel reads the chunk states: an fp32 copy of P would cost
    4 bytes per token, head and key channel (48 GiB at 1M tokens and 96 heads)."""
    corr = torch.einsum("bthk,bhkv->bthv", P, S_in.to(P.dtype))
    return o_zero + corr.to(o_zero.dtype)


def scan_states(M: Sequence[torch.Tensor], S: Sequence[torch.Tensor], S0: torch.Tensor | None = None):
    """R transitions M_r [..,K,K] and local states S~_r [..,K,V] -> [S_in(0), ..., S_in(R)] (R+1 states):
    S_in(0) = S0 (zeros if None), S_in(r+1) = M_r S_in(r) + S~_r; the last is the state after every segment."""
    M, S = list(M), list(S)
    if len(M) != len(S) or not S:
        raise ValueError(f"scan_states needs one transition per local state and at least one; got {len(M)} and {len(S)}")
    state = torch.zeros_like(S[0]) if S0 is None else S0.to(S[0].dtype)
    states = [state]
    for M_r, S_r in zip(M, S):
        state = M_r @ state + S_r
        states.append(state)
    return states


def intra_device_cp_kda(q, k, v, g, beta, num_segments: int, scale=None, initial_state=None,
                        output_final_state=False, chunk_size=64, backend="auto", lower_bound=None):
    """chunk_kda over R = ``num_segments`` segments of each sequence run side by side; exact (outputs, final
    state, gradients) against chunk_kda on the whole sequence.

    q, k, g [B,T,H,K], v [B,T,H,V], beta [B,T,H], initial_state [B,H,K,V] -> (o [B,T,H,V], final [B,H,K,V] or None).
    Segments are ceil(T / R) long; the last is zero-padded (g = 0 keeps the state, beta = 0 writes nothing).
    """
    if num_segments < 1:
        raise ValueError(f"num_segments must be >= 1; got {num_segments}")
    B, T, H, K = q.shape
    Vd, R = v.shape[-1], num_segments
    L = -(-T // R)
    pad = R * L - T

    def split(x):  # [B,T,...] -> [B*R, L, ...]; row b*R + r is segment r of sequence b
        if pad:
            x = F.pad(x, [0, 0] * (x.dim() - 2) + [0, pad])
        return x.reshape(B * R, L, *x.shape[2:])

    qs, ks, vs, gs, bs = (split(x) for x in (q, k, v, g, beta))
    # phase 1: every segment at once, from the zero state, with its affine map and its outputs' sensitivity P
    o_zero, P, M, S_loc = segment_outputs(qs, ks, vs, gs, bs, scale, chunk_size, backend, lower_bound)
    states = scan_states(M.view(B, R, H, K, K).unbind(1), S_loc.view(B, R, H, K, Vd).unbind(1), initial_state)
    S_in = torch.stack(states[:-1], dim=1).reshape(B * R, H, K, Vd)  # phase 2: R small matmuls
    o = apply_initial_state(o_zero, P, S_in)  # phase 3: one product per token
    o = o.reshape(B, R * L, H, Vd)[:, :T]
    return o, (states[-1] if output_final_state else None)
