"""KCP: context parallelism for KDA over a process group (SPEC §8), and the short-conv halo it needs.

Legend: B batch, T this rank's tokens, H heads, K key dim, V value dim, D channels, W conv width, R ranks,
r this rank, N local document pieces. Rank r holds the r-th contiguous segment of every sequence (the same
cut for the whole batch; segment lengths may differ between ranks).

Forward (the math of the segment map and the scan is in ``k3/ops/kda/cp.py``):
  1. (M_r [B,H,K,K], S~_r [B,H,K,V]) = segment summary of the local tokens (fp32);
  2. ONE all-gather of [M_r | S~_r]: [B,H,K,K+V] per rank, whatever T is;
  3. S_in(r) = scan over j < r of  S <- M_j S + S~_j,  from S = 0;
  4. o_r = o~ + P S_in(r), exact: steps 1 and 4 are ONE chunk_kda call with values [v | 0] from [0 | I], whose
     extra output columns are P, the outputs' sensitivity to the carried state (``k3.ops.kda.cp``).
Backward (``_ScanAcrossRanks``): step 4's backward gives D_r = dL/dS_in(r). ONE all-gather of the D's
([B,H,K,V] per rank), then every rank runs the adjoint scan over the ranks after it, with the M_j it kept:

    lam = 0;  for j = R-1 down to r+1:  lam = D_j + M_j^T lam        (lam = dL/dS_in(r+1))
    dS~_r = lam,   dM_r = lam S_in(r)^T

and local autograd carries these through step 1 into k, v, g, beta. No reduce-scatter is needed.

Packed documents (B = 1). Each rank passes ``cu_seqlens``: the boundaries of the document pieces it holds,
LOCAL to its segment ([0, ..., T]), and ``first_doc_continues``: whether its piece 0 continues the document of
the previous rank's last piece (False when a document starts exactly at this rank's first token; ignored on
rank 0). ``local_cu_seqlens(global_cu, start, end)`` derives both from the global boundaries. Then:
  - only piece 0 receives S_in(r), and only if it continues: it starts from [0 | I], every other piece from
    [0 | 0], so P is zero outside a continuing piece 0;
  - only the LAST local piece can carry a state onward: (M_r, S~_r) are its final state's. If a document starts
    in the segment, that piece started from [0 | 0], so M_r = 0 and the scan is cut there; else (the whole
    segment lies inside one document) they are the whole segment's.

Every rank must run the backward of every KCP call (as with DDP): the backward all-gathers are collectives.

The GLOBAL interface (``cp_chunk_kda``): B = 1 packed documents, the GLOBAL ``cu_seqlens`` on every rank, and the
packed sequence cut into R equal contiguous slices (total tokens divisible by R); rank r passes tokens
[r T/R, (r+1) T/R) and gets their outputs. Two implementations behind it, drop-in comparable:
  - impl="k3"  (``_kcp_global``): the KCP above, through ``local_cu_seqlens``; any device, any backend
    (fla's kernels for the local chunks on CUDA, the torch reference elsewhere), final states available through
    ``kcp_chunk_kda`` itself;
  - impl="fla" (``_fla_cp``): fla-core's own CP (``fla.ops.cp.build_cp_context`` + ``chunk_kda(...,
    cp_context=...)``); CUDA and fla-core only, no initial/final states.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..ops.kda.cp import apply_initial_state, scan_states, segment_outputs
from ..ops.kda.fla import fla_build_cp_context, fla_chunk_kda_cp, fla_cp_available, fla_dtype_error
from ..ops.short_conv import short_conv
from ..ops.varlen import cached_plan

__all__ = ["kcp_chunk_kda", "kcp_short_conv", "local_cu_seqlens", "equal_split", "cp_chunk_kda", "CP_IMPLS"]

CP_IMPLS = ("k3", "fla")


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
    """Where this rank's last local piece starts (0 unpacked), after checking the local boundaries: once per
    cu_seqlens tensor (``cached_plan``), not in each of a forward's KCP calls."""
    if cu_seqlens is None:
        return 0
    if batch != 1:
        raise ValueError(f"with cu_seqlens the local inputs must be packed into batch 1; got batch {batch}")
    return cached_plan(cu_seqlens, ("kcp last piece", T), lambda cu: _checked_last_start(cu, T))


def _checked_last_start(cu: list[int], T: int) -> int:
    if len(cu) < 2 or cu[0] != 0 or cu[-1] != T:
        raise ValueError(f"cu_seqlens must be LOCAL to this rank: 1-D, from 0 to T={T}; got {cu}")
    if any(b <= a for a, b in zip(cu, cu[1:])):
        raise ValueError(f"local document pieces must be non-empty (strictly increasing cu_seqlens); got "
                         f"{cu}. local_cu_seqlens(global_cu, start, end) builds them.")
    return cu[-2]


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
    _last_piece_start(T, cu_seqlens, B)  # checks the local boundaries
    carried = None
    if cu_seqlens is not None:  # only piece 0 takes the carried state, and only if it continues a document
        carried = torch.zeros(cu_seqlens.numel() - 1, device=q.device)
        carried[0] = float(first_doc_continues)
    # ONE pass: o~ and P for every token; the last piece's (M, S~) (M = 0 when a document starts in the segment)
    o_zero, P, M, S_loc = segment_outputs(q, k, v, g, beta, scale, chunk_size, backend, lower_bound, cu_seqlens,
                                          carried)
    last = slice(-1, None) if cu_seqlens is not None else slice(None)
    S_in = _ScanAcrossRanks.apply(M[last], S_loc[last], group)  # [B,H,K,V] ([1,...] packed)
    final = S_loc + M @ S_in if output_final_state else None
    return apply_initial_state(o_zero, P, S_in), final


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


# ---------------------------------------------------------------- the GLOBAL interface: k3's KCP or fla-core's CP


def equal_split(total: int, world: int, rank: int) -> tuple[int, int]:
    """[start, end) of rank ``rank``'s slice when ``total`` packed tokens are cut into ``world`` equal contiguous
    slices (fla's 'contiguous' layout)."""
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"rank {rank} is not one of {world} ranks")
    if total < world or total % world:
        raise ValueError(f"the packed sequence's {total} tokens must be a positive multiple of the {world} ranks "
                         f"(equal contiguous split); pad the packed batch to a multiple of {world}")
    n = total // world
    return rank * n, (rank + 1) * n


def _check_global_shapes(q, k, v, g, beta, cu_seqlens) -> None:
    """Checks that need no process group (raised before any collective, identically on every rank)."""
    if q.dim() != 4:
        raise ValueError(f"q must be [1, T/R, H, K]; got shape {tuple(q.shape)}")
    B, T, H, K = q.shape
    if B != 1:
        raise ValueError(f"the global CP interface takes documents packed into batch 1 (with cu_seqlens); "
                         f"got batch {B}")
    if k.shape != q.shape or g.shape != q.shape:
        raise ValueError(f"q, k and g must have the same shape [1, T/R, H, K]; got q {tuple(q.shape)}, "
                         f"k {tuple(k.shape)}, g {tuple(g.shape)}")
    if v.dim() != 4 or v.shape[:3] != q.shape[:3]:
        raise ValueError(f"v must be [1, T/R, H, V] with q's [1, T/R, H] = {tuple(q.shape[:3])}; got {tuple(v.shape)}")
    if beta.shape != q.shape[:3]:
        raise ValueError(f"beta must be [1, T/R, H] = {tuple(q.shape[:3])}; got {tuple(beta.shape)}")
    if cu_seqlens is not None:
        if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2 or cu_seqlens.is_floating_point():
            raise ValueError(f"cu_seqlens must be a 1-D integer tensor of GLOBAL boundaries [0, ..., total]; "
                             f"got {cu_seqlens}")
        cu = cu_seqlens.tolist()
        if cu[0] != 0 or any(b <= a for a, b in zip(cu, cu[1:])):
            raise ValueError(f"cu_seqlens must start at 0 and strictly increase (non-empty documents); got {cu}")


def _global_split(q, cu_seqlens, group) -> tuple[torch.Tensor, int, int]:
    """-> (global cu_seqlens on the CPU, start, end) of this rank's slice; checks it is the slice passed."""
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("the global CP interface needs an initialized torch.distributed process group "
                           "(torchrun / init_process_group); a single process can use k3.ops.kda.chunk_kda")
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    T = q.shape[1]
    cu = (torch.tensor([0, T * world]) if cu_seqlens is None else cu_seqlens.detach().to("cpu", torch.long))
    total = int(cu[-1])
    start, end = equal_split(total, world, rank)
    if end - start != T:
        raise ValueError(f"cu_seqlens covers {total} tokens, so each of the {world} ranks must pass its own "
                         f"{total // world}-token slice [1, {total // world}, H, K]; rank {rank} passed {T} tokens")
    return cu, start, end


def _kcp_global(q, k, v, g, beta, cu_seqlens=None, group=None, scale=None, lower_bound=None,
                         backend="auto", chunk_size=64):
    """k3's KCP behind the GLOBAL interface: this rank's outputs o [1, T/R, H, V].

    q, k, g [1, T/R, H, K], v [1, T/R, H, V], beta [1, T/R, H]: this rank's equal contiguous slice of the packed
    sequence; ``cu_seqlens``: the GLOBAL document boundaries [0, ..., T] (None: one document), the same on every
    rank. Same arguments as ``_fla_cp``; ``backend``/``chunk_size`` pick the local kernels as in
    ``kcp_chunk_kda`` (which also gives final states). Every rank must run the backward.
    """
    _check_global_shapes(q, k, v, g, beta, cu_seqlens)
    cu, start, end = _global_split(q, cu_seqlens, group)
    cu_loc, continues = local_cu_seqlens(cu, start, end)
    o, _ = kcp_chunk_kda(q, k, v, g, beta, group, scale, cu_loc.to(q.device), continues, False, chunk_size,
                         backend, lower_bound)
    return o


def _fla_cp(q, k, v, g, beta, cu_seqlens=None, group=None, scale=None, lower_bound=None):
    """fla-core's own context parallelism behind the GLOBAL interface (``fla.ops.cp.build_cp_context`` and
    ``fla.ops.kda.chunk_kda(..., cp_context=...)``, 'contiguous' layout): this rank's outputs o [1, T/R, H, V].

    Arguments as ``_kcp_global``. Needs fla-core (with triton) and CUDA tensors; there is no initial or
    final state under fla's CP. Every rank must run the backward.
    """
    _check_global_shapes(q, k, v, g, beta, cu_seqlens)
    if not fla_cp_available(q):
        if not q.is_cuda:
            why = f"the tensors are on {q.device}"
        else:
            why = fla_dtype_error(q) or "fla-core's fla.ops.cp does not import here"
        raise RuntimeError(f"cp_chunk_kda(impl='fla') needs fla-core with triton on CUDA tensors ({why}); "
                           "cp_chunk_kda(impl='k3') is the portable path (any device, "
                           "torch or fla local kernels)")
    cu, _, _ = _global_split(q, cu_seqlens, group)
    if cu_seqlens is None or cu_seqlens.device != q.device or cu_seqlens.dtype not in (torch.int32, torch.long):
        cu_seqlens = cu.to(q.device)  # fla caches the context by the tensor's identity: pass a device tensor
    ctx = fla_build_cp_context(cu_seqlens, group if group is not None else dist.group.WORLD)  # None would mean no CP
    return fla_chunk_kda_cp(q, k, v, g, beta, ctx, scale, lower_bound)


def cp_chunk_kda(q, k, v, g, beta, cu_seqlens=None, group=None, scale=None, lower_bound=None, impl="k3",
                 backend="auto", chunk_size=64):
    """Context-parallel chunk_kda behind the GLOBAL interface; ``impl``: "k3" (``_kcp_global``, portable)
    or "fla" (``_fla_cp``, fla-core on CUDA). ``backend`` and ``chunk_size`` choose impl="k3"'s local
    kernels; impl="fla" always runs fla's (64-token chunks)."""
    if impl == "k3":
        return _kcp_global(q, k, v, g, beta, cu_seqlens, group, scale, lower_bound, backend, chunk_size)
    if impl == "fla":
        if backend not in ("auto", "fla") or chunk_size != 64:
            raise ValueError(f"impl='fla' runs fla-core's kernels with 64-token chunks; backend={backend!r} and "
                             f"chunk_size={chunk_size} apply to impl='k3' only")
        return _fla_cp(q, k, v, g, beta, cu_seqlens, group, scale, lower_bound)
    raise ValueError(f"unknown CP implementation {impl!r}; expected one of {CP_IMPLS}")
