"""KCP: context parallelism for KDA over a process group (SPEC §8), and the short-conv halo it needs.

Legend: B batch, T this rank's tokens, H heads, K key dim, V value dim, D channels, W conv width, R ranks,
r this rank, N local document pieces. Rank r holds the r-th contiguous segment of every sequence (the same
cut for the whole batch; segment lengths may differ between ranks).

Forward (the math of the segment map and the scan is in ``k3/ops/kda/cp.py``):
  1. (M_r [B,H,K,K], S~_r [B,H,K,V]) = segment summary of the local tokens (fp32);
  2. ONE all-gather of [M_r | S~_r]: [B,H,K,K+V] per rank, whatever T is;
  3. S_in(r) = scan over j < r of  S <- M_j S + S~_j,  from S = 0;
  4. o_r = chunk_kda(local tokens, initial_state = S_in(r)), exact.
Backward (``_ScanAcrossRanks``): step 4's backward gives D_r = dL/dS_in(r). ONE all-gather of the D's
([B,H,K,V] per rank), then every rank runs the adjoint scan over the ranks after it, with the M_j it kept:

    lam = 0;  for j = R-1 down to r+1:  lam = D_j + M_j^T lam        (lam = dL/dS_in(r+1))
    dS~_r = lam,   dM_r = lam S_in(r)^T

and local autograd carries these through step 1 into k, v, g, beta. No reduce-scatter is needed.

Packed documents (B = 1). Each rank passes ``cu_seqlens``: the boundaries of the document pieces it holds,
LOCAL to its segment ([0, ..., T]), and ``first_doc_continues``: whether its piece 0 continues the document of
the previous rank's last piece (False when a document starts exactly at this rank's first token; ignored on
rank 0). ``local_cu_seqlens(global_cu, start, end)`` derives both from the global boundaries. Then:
  - only the LAST local piece can carry a state onward, so the summary covers the tail after the last local
    document start: if that tail starts a document (its start > 0, or it is piece 0 and does not continue)
    then M_r = 0 and S~_r = the tail's zero-start state, which cuts the scan there; else (the whole segment lies
    inside one document) M_r, S~_r are the whole segment's;
  - only piece 0 receives S_in(r), and only if it continues; the other pieces start from zero.

Every rank must run the backward of every KCP call (as with DDP): the backward all-gathers are collectives.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..ops.kda.cp import chunk_kda_any, scan_states, segment_summary
from ..ops.short_conv import short_conv

__all__ = ["kcp_chunk_kda", "kcp_short_conv", "local_cu_seqlens"]


def _all_gather(x: torch.Tensor, group) -> list[torch.Tensor]:
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return parts


class _ScanAcrossRanks(torch.autograd.Function):
    """(M_r, S~_r) on every rank -> S_in(r); the backward is the adjoint scan over the later ranks."""

    @staticmethod
    def forward(ctx, M, S, group):
        r, K = dist.get_rank(group), M.shape[-1]
        parts = _all_gather(torch.cat([M, S], dim=-1), group)  # R x [B,H,K,K+V]
        Ms, Ss = [p[..., :K] for p in parts], [p[..., K:] for p in parts]
        S_in = scan_states(Ms[:r], Ss[:r])[-1] if r else torch.zeros_like(S)
        ctx.group = group
        ctx.save_for_backward(S_in, *Ms[r + 1:])
        return S_in

    @staticmethod
    def backward(ctx, dS_in):
        S_in, *M_later = ctx.saved_tensors
        D = _all_gather(dS_in, ctx.group)  # R x [B,H,K,V]
        r = dist.get_rank(ctx.group)
        lam = torch.zeros_like(dS_in)
        for j in range(len(D) - 1, r, -1):
            lam = D[j] + M_later[j - r - 1].transpose(-1, -2) @ lam
        dM = lam @ S_in.transpose(-1, -2) if ctx.needs_input_grad[0] else None
        return dM, (lam if ctx.needs_input_grad[1] else None), None


class _HaloFromPrevious(torch.autograd.Function):
    """tail [B,W-1,D] of every rank -> the previous rank's tail (zeros on rank 0); backward sends the halo's
    gradient back to the rank it came from."""

    @staticmethod
    def forward(ctx, tail, group):
        r = dist.get_rank(group)
        parts = _all_gather(tail, group)
        ctx.group = group
        return parts[r - 1] if r > 0 else torch.zeros_like(tail)

    @staticmethod
    def backward(ctx, d_halo):
        r = dist.get_rank(ctx.group)
        parts = _all_gather(d_halo, ctx.group)
        return (parts[r + 1] if r + 1 < len(parts) else torch.zeros_like(d_halo)), None


def local_cu_seqlens(cu_seqlens: torch.Tensor, start: int, end: int) -> tuple[torch.Tensor, bool]:
    """Global document boundaries and this rank's token range [start, end) -> (local cu_seqlens [0, .., end-start],
    first_doc_continues: True when ``start`` falls strictly inside a document)."""
    bounds = [int(c) for c in cu_seqlens.tolist()]
    if not 0 <= start < end <= bounds[-1]:
        raise ValueError(f"rank range [{start}, {end}) must be a non-empty part of [0, {bounds[-1]})")
    inner = [c - start for c in bounds if start < c < end]
    cu = torch.tensor([0, *inner, end - start], dtype=torch.long, device=cu_seqlens.device)
    return cu, (start > 0 and start not in bounds)


def _last_piece_start(T: int, cu_seqlens: torch.Tensor | None, batch: int) -> int:
    if cu_seqlens is None:
        return 0
    if batch != 1:
        raise ValueError(f"with cu_seqlens the local inputs must be packed into batch 1; got batch {batch}")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2 or int(cu_seqlens[0]) != 0 or int(cu_seqlens[-1]) != T:
        raise ValueError(f"cu_seqlens must be LOCAL to this rank: 1-D, from 0 to T={T}; got {cu_seqlens.tolist()}")
    if bool((cu_seqlens[1:] <= cu_seqlens[:-1]).any()):
        raise ValueError(f"local document pieces must be non-empty (strictly increasing cu_seqlens); got "
                         f"{cu_seqlens.tolist()}. local_cu_seqlens(global_cu, start, end) builds them.")
    return int(cu_seqlens[-2])


def _first_piece_state(state: torch.Tensor, cu_seqlens, continues: bool) -> torch.Tensor:
    """[1, ...] carried state -> [N, ...] initial states: piece 0 gets it if it continues, the others zeros.
    A non-continuing piece 0 still gets ``state * 0`` so that this rank joins the backward collective."""
    if cu_seqlens is None:
        return state
    first = state if continues else state * 0.0
    return torch.cat([first, state.new_zeros(cu_seqlens.numel() - 2, *state.shape[1:])])


def kcp_chunk_kda(q, k, v, g, beta, group=None, scale=None, cu_seqlens=None, first_doc_continues=True,
                  output_final_state=False, chunk_size=64, backend="auto", lower_bound=None):
    """chunk_kda of this rank's segment with the exact state carried in from the lower ranks.

    q, k, g [B,T,H,K], v [B,T,H,V], beta [B,T,H] (this rank's tokens) -> (o [B,T,H,V], final [N,H,K,V] or None);
    N = B, or the number of local pieces with ``cu_seqlens`` (local, see the module docstring). The final state
    of the last rank's last piece is the state at the end of the global sequence. Every sequence starts from the
    zero state (training); every rank holds at least one token.
    """
    B, T, H, K = q.shape
    start = _last_piece_start(T, cu_seqlens, B)
    resets = cu_seqlens is not None and (start > 0 or not first_doc_continues)
    opts = dict(chunk_size=chunk_size, backend=backend, lower_bound=lower_bound)
    tail = [x[:, start:] for x in (k, v, g, beta)]
    if resets:  # a document starts in the tail: nothing from the lower ranks goes past it
        _, S_loc = chunk_kda_any(tail[0], *tail, scale=1.0, output_final_state=True, **opts)
        M = S_loc.new_zeros(B, H, K, K)
    else:
        M, S_loc = segment_summary(*tail, **opts)
    S_in = _ScanAcrossRanks.apply(M, S_loc, group)  # [B,H,K,V]
    h0 = _first_piece_state(S_in, cu_seqlens, first_doc_continues)
    return chunk_kda_any(q, k, v, g, beta, scale, h0, output_final_state, cu_seqlens, **opts)


def kcp_short_conv(x, weight, group=None, cu_seqlens=None, first_doc_continues=True, activation=True):
    """short_conv of this rank's segment with the W-1 tokens before it taken from the previous rank (one
    all-gather of [B,W-1,D] forward, one backward). x [B,T,D] with T >= W-1, weight [D,1,W] -> y [B,T,D].

    ``cu_seqlens`` / ``first_doc_continues``: as for ``kcp_chunk_kda``. The halo never crosses a document start:
    sent tokens before the start of the sender's last piece are zeroed (a document starts from zeros).
    """
    B, T, D = x.shape
    W = weight.shape[-1]
    if W == 1:
        return short_conv(x, weight, cu_seqlens=cu_seqlens, activation=activation)[0]
    if T < W - 1:
        raise ValueError(f"kcp_short_conv needs at least W-1 = {W - 1} tokens per rank; this rank has {T}")
    start = _last_piece_start(T, cu_seqlens, B)
    pos = torch.arange(T - (W - 1), T, device=x.device)
    tail = x[:, T - (W - 1):] * (pos >= start).to(x.dtype)[None, :, None]  # [B,W-1,D]
    halo = _HaloFromPrevious.apply(tail, group)
    state = _first_piece_state(halo.transpose(1, 2), cu_seqlens, first_doc_continues)  # [N,D,W-1], oldest first
    return short_conv(x, weight, state=state, cu_seqlens=cu_seqlens, activation=activation)[0]
