"""Kimi Delta Attention, pure PyTorch (SPEC §2.1): the recurrence and its chunkwise (WY) form.

Shape legend: B batch, T time, H heads, K key dim, V value dim, N sequences, C chunk, t tile.
Conventions follow fla-core: q, k [B,T,H,K]; v [B,T,H,V]; g = log-decay [B,T,H,K] (<= 0);
beta [B,T,H] after the sigmoid; initial_state / final state [N,H,K,V] in fp32; with ``cu_seqlens``
the batch is 1 and holds N packed documents whose states reset at each boundary.

Both functions compute in fp32 (fp64 when given fp64, for gradcheck) and return o in v's dtype.
The chunk form never exponentiates a positive number, so neither it nor its backward can overflow
(the masked upper triangle is filled before ``exp``; see README.md in this folder).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..varlen import cached_plan, grouped_documents, pack_sequences, unpack_sequences

# a length group's fixed cost in chunks of work (its gather, scatter and Python loop), for ``length_groups``
GROUP_OVERHEAD_CHUNKS = 4

__all__ = ["recurrent_kda", "chunk_kda"]


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _check_inputs(q, k, v, g, beta, initial_state, cu_seqlens):
    if q.dim() != 4 or k.shape != q.shape:
        raise ValueError(f"q and k must both be [B,T,H,K]; got q {tuple(q.shape)}, k {tuple(k.shape)}")
    B, T, H, K = q.shape
    if v.dim() != 4 or v.shape[:3] != (B, T, H):
        raise ValueError(f"v must be [B,T,H,V] = [{B},{T},{H},V]; got {tuple(v.shape)}")
    if g.shape != q.shape:
        raise ValueError(f"g (log-decay) must be [B,T,H,K] = {tuple(q.shape)}; got {tuple(g.shape)}")
    if beta.shape != (B, T, H):
        raise ValueError(f"beta must be [B,T,H] = [{B},{T},{H}] (after the sigmoid); got {tuple(beta.shape)}")
    N = B
    if cu_seqlens is not None:
        if B != 1:
            raise ValueError(f"with cu_seqlens the inputs must be packed into batch 1; got batch {B}")
        if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2 or int(cu_seqlens[0]) != 0 or int(cu_seqlens[-1]) != T:
            raise ValueError(f"cu_seqlens must be 1-D, start at 0 and end at T={T}; got {cu_seqlens.tolist()}")
        if bool((cu_seqlens[1:] < cu_seqlens[:-1]).any()):
            raise ValueError(f"cu_seqlens must be non-decreasing; got {cu_seqlens.tolist()}")
        N = cu_seqlens.numel() - 1
    if initial_state is not None and initial_state.shape != (N, H, K, v.shape[-1]):
        raise ValueError(
            f"initial_state must be [N,H,K,V] = [{N},{H},{K},{v.shape[-1]}] (N = number of sequences); "
            f"got {tuple(initial_state.shape)}"
        )


def _to_batch(tensors, cu_seqlens):
    """Packed documents -> one zero right-padded row each (g = 0 keeps the state, beta = 0 writes nothing), and
    the rows' layout; unpacked inputs as they are."""
    if cu_seqlens is None:
        return tensors, None
    rows = [pack_sequences(x, cu_seqlens) for x in tensors]
    return [r for r, _ in rows], rows[0][1]


def recurrent_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Token-by-token KDA: S_t = (I - b k k^T) Diag(exp g_t) S_{t-1} + b k v^T, o_t = scale * S_t^T q_t.

    Used for decode (T small) and as the ground truth for ``chunk_kda``.
    """
    _check_inputs(q, k, v, g, beta, initial_state, cu_seqlens)
    dtype, cdt = v.dtype, _compute_dtype(v)
    K = q.shape[-1]
    scale = K**-0.5 if scale is None else scale
    (q, k, v, g, beta), rows = _to_batch([x.to(cdt) for x in (q, k, v, g, beta)], cu_seqlens)
    B, Tb, H, _ = q.shape
    S = q.new_zeros(B, H, K, v.shape[-1]) if initial_state is None else initial_state.to(cdt)
    q = q * scale
    outs = []
    for t in range(Tb):
        k_t = k[:, t]  # [B,H,K]
        S = S * g[:, t].exp()[..., None]
        v_new = v[:, t] - torch.einsum("bhk,bhkv->bhv", k_t, S)  # what S already predicts for k_t is erased
        S = S + torch.einsum("bhk,bhv->bhkv", k_t * beta[:, t, :, None], v_new)
        outs.append(torch.einsum("bhk,bhkv->bhv", q[:, t], S))
    o = torch.stack(outs, dim=1) if outs else v.new_zeros(B, 0, H, v.shape[-1])
    o = (unpack_sequences(o, rows) if rows is not None else o).to(dtype)
    return o, (S if output_final_state else None)


_SAFE_SPAN = 80.0  # e^80 ~ 5.5e34 < fp32 max 3.4e38


def _decay_scores(a, b, ga, gb, tile: int, inclusive: bool):
    """scores[..., i, j] = sum_d a_i[d] b_j[d] exp(ga_i[d] - gb_j[d]) for j < i (j <= i if inclusive), else 0.

    a, b, ga, gb: [..., C, K] with ga, gb cumulative log-decays (non-increasing along C). No exponent exceeds
    SAFE_SPAN: an off-diagonal tile (I, J), I > J, is factored through the last position r of tile J,
    exp(ga_i - gb_r) * exp(gb_r - gb_j), both <= 0; a diagonal t x t tile is factored through its first
    position when its decay span allows, else its [t, t, K] exponents are masked before ``exp``.
    """
    *lead, C, K = a.shape
    nt = C // tile
    a_t, b_t = a.view(*lead, nt, tile, K), b.view(*lead, nt, tile, K)
    ga_t, gb_t = ga.view(*lead, nt, tile, K), gb.view(*lead, nt, tile, K)
    keep = torch.ones(tile, tile, dtype=torch.bool, device=a.device).tril(0 if inclusive else -1)
    span = (gb_t[..., :1, :] - ga_t[..., -1:, :]).detach().amax() if a.numel() else 0.0
    if float(span) <= _SAFE_SPAN:
        # the decay inside one tile stays above e^-SAFE_SPAN (K3's gate floor of -5 gives at most 80 over 16
        # tokens): factor through the tile's first position, one matmul per tile, mask the finite upper part
        ref = gb_t[..., :1, :]
        diag = (a_t * (ga_t - ref).exp()) @ (b_t * (ref - gb_t).exp()).transpose(-1, -2)
        diag = diag.masked_fill(~keep, 0.0)
    else:  # an unbounded gate (softplus) decayed further: mask the [t, t, K] exponents before exp
        diff = ga_t[..., :, None, :] - gb_t[..., None, :, :]  # [..., nt, t, t, K]
        diff = diff.masked_fill(~keep[..., None], float("-inf"))
        diag = torch.einsum("...ik,...jk,...ijk->...ij", a_t, b_t, diff.exp())  # [..., nt, t, t]
    rows = []
    for I in range(nt):
        blocks = []
        for J in range(nt):
            if J < I:
                ref = gb_t[..., J, -1:, :]  # [..., 1, K]
                ai = a_t[..., I, :, :] * (ga_t[..., I, :, :] - ref).exp()
                bj = b_t[..., J, :, :] * (ref - gb_t[..., J, :, :]).exp()
                blocks.append(ai @ bj.transpose(-1, -2))
            elif J == I:
                blocks.append(diag[..., I, :, :])
            else:
                blocks.append(a.new_zeros(*lead, tile, tile))
        rows.append(torch.cat(blocks, dim=-1))
    return torch.cat(rows, dim=-2)  # [..., C, C]


def chunk_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    chunk_size: int = 64,
    tile: int = 16,
    group_overhead: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Chunkwise-parallel KDA (WY representation), exact against ``recurrent_kda``.

    Inside a chunk, with G = cumsum(g): L[i,j] = b_i sum_d k_i k_j exp(G_i - G_j) (j < i);
    W = (I + L)^-1 diag(b) (exp(G) * K), U = (I + L)^-1 diag(b) V. Across chunks (sequential):
    V' = U - W S,  O = (Q exp(G)) S + causal(QK decay) V',  S <- exp(G_C) S + (K exp(G_C - G))^T V'.

    Packed documents run as padded rows, documents of similar length together (``length_groups`` with the
    work of a group = its count x its longest, in chunks): a long document does not pad the short ones.
    ``group_overhead``: a group's fixed cost in chunks (default ``GROUP_OVERHEAD_CHUNKS``); ``inf`` pads every
    document to the longest, in one batch.
    """
    _check_inputs(q, k, v, g, beta, initial_state, cu_seqlens)
    if chunk_size % tile:
        raise ValueError(f"chunk_size ({chunk_size}) must be a multiple of tile ({tile})")
    dtype, cdt = v.dtype, _compute_dtype(v)
    K = q.shape[-1]
    scale = K**-0.5 if scale is None else scale
    xs = [x.to(cdt) for x in (q, k, v, g, beta)]
    h0 = initial_state.to(cdt) if initial_state is not None else None
    if cu_seqlens is None:
        T = q.shape[1]
        xs = [F.pad(x, [0, 0] * (x.dim() - 2) + [0, (-T) % chunk_size]) for x in xs]
        o, S = _chunk_rows(*xs, scale, h0, chunk_size, tile)
        return o[:, :T].to(dtype), (S if output_final_state else None)
    overhead = GROUP_OVERHEAD_CHUNKS if group_overhead is None else group_overhead
    return _chunk_documents(xs, scale, h0, output_final_state, cu_seqlens, chunk_size, tile, dtype, overhead)


def _chunk_documents(xs, scale, h0, output_final_state, cu_seqlens, C, tile, dtype, overhead):
    """Packed documents [1,T,...]: each length group gathered into zero-padded rows (g = 0 keeps the state,
    beta = 0 writes nothing), run by ``_chunk_rows``, the outputs put back in packed order."""
    q = xs[0]
    H, Vd = q.shape[2], xs[2].shape[-1]
    plan = cached_plan(cu_seqlens, ("kda", C, overhead, q.device),
                       lambda cu: grouped_documents(cu, overhead, 1, q.device, unit=C))  # work: count x longest
    n_docs = cu_seqlens.numel() - 1
    finals = None  # per document, in order; an empty document's is its initial state
    if output_final_state:
        finals = list(h0) if h0 is not None else [q.new_zeros(H, q.shape[-1], Vd)] * n_docs
    outs = []
    for grp in plan.groups:  # the longest document first
        rows = [grp.pad(x[0]) for x in xs]  # zero padding: g = 0 keeps the state, beta = 0 writes nothing
        o, S = _chunk_rows(*rows, scale, h0[list(grp.documents)] if h0 is not None else None, C, tile)
        outs.append(o)
        if finals is not None:
            for j, d in enumerate(grp.documents):
                finals[d] = S[j]
    o = plan.scatter(outs)[None] if outs else q.new_zeros(1, 0, H, Vd)
    return o.to(dtype), (torch.stack(finals) if finals is not None else None)


def _chunk_rows(q, k, v, g, beta, scale, initial_state, C, tile):
    """The chunk form on rows [B,Tp,...] (Tp a multiple of C, compute dtype) -> (o [B,Tp,H,V], final state)."""
    B, Tp, H, K = q.shape
    Vd = v.shape[-1]
    n = Tp // C

    # [B,T,H,*] -> [B,H,n,C,*]
    def chunks(x):
        return x.view(B, n, C, H, *x.shape[3:]).transpose(1, 3).transpose(2, 3)

    q, k, v, g = chunks(q) * scale, chunks(k), chunks(v), chunks(g)
    beta = beta.view(B, n, C, H).permute(0, 3, 1, 2)  # [B,H,n,C]
    G = g.cumsum(-2)  # [B,H,n,C,K]

    eye = torch.eye(C, dtype=q.dtype, device=q.device)
    L = beta[..., None] * _decay_scores(k, k, G, G, tile, inclusive=False)
    W = torch.linalg.solve_triangular(eye + L, beta[..., None] * (k * G.exp()), upper=False, unitriangular=True)
    U = torch.linalg.solve_triangular(eye + L, beta[..., None] * v, upper=False, unitriangular=True)
    Aqk = _decay_scores(q, k, G, G, tile, inclusive=True)  # [B,H,n,C,C]
    q_dec = q * G.exp()
    G_end = G[..., -1:, :]  # [B,H,n,1,K]
    k_dec = k * (G_end - G).exp()

    S = q.new_zeros(B, H, K, Vd) if initial_state is None else initial_state
    outs = []
    for c in range(n):
        v_new = U[:, :, c] - W[:, :, c] @ S  # [B,H,C,V]
        outs.append(q_dec[:, :, c] @ S + Aqk[:, :, c] @ v_new)
        S = S * G_end[:, :, c].transpose(-1, -2).exp() + k_dec[:, :, c].transpose(-1, -2) @ v_new
    o = torch.stack(outs, dim=2) if outs else q.new_zeros(B, H, 0, C, Vd)  # [B,H,n,C,V]
    return o.permute(0, 2, 3, 1, 4).reshape(B, Tp, H, Vd), S
