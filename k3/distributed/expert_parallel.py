"""Expert parallelism for Stable LatentMoE with MoonEP's exactly balanced plan (SPEC §8), applied from outside.

``parallelize_moe(moe, group)`` swaps ``moe.experts`` (an ExpertBank) for an ``ExpertParallelBank`` that keeps only
this rank's E/R experts (rank r owns experts [r*m, (r+1)*m)); the router, the latent down/up projections,
routed_expert_norm and the shared experts stay replicated (data parallel: all-reduce their gradients as DP does).
``LatentMoE.forward`` is unchanged: it calls ``self.experts(z, weights, idx)`` as before.

One forward on rank r (its N local tokens, k slots each):
  1. route locally (the replicated router) -> idx [N,k], weights [N,k];
  2. ONE all-gather of the per-expert slot counts [E] -> counts [R,E]; loads = counts.sum(0);
  3. ``plan_arrays(loads, R)`` on every rank: the same plan everywhere (the planner is deterministic);
  4. an expert's slots are ordered globally by (source rank, local position); plan entry (q, j) computes the
     range [offsets, offsets + counts) of expert experts[q, j], so pieces[s, q, j] = the overlap of that range
     with source s's slots says how many rows s sends to q for that entry (``dispatch_layout``);
  5. replica weights: an all-to-all of the flattened (w1, w3, w2) from each owner to each rank hosting a replica
     of that expert, only the (expert, host) pairs of the plan (skipped when the plan has no replica);
  6. dispatch all-to-all of the latent rows z: every rank receives exactly sum(loads)/R rows (= S*k when every
     rank has S tokens): a static shape;
  7. grouped matmul per plan entry (SiTU-GLU expert, fake-quantised as ExpertBank's under QAT: MXFP4 blocks lie
     along each expert row, so quantising a fetched replica equals quantising the owner's), then the reverse
     all-to-all sends results home;
  8. combine as ExpertBank does: rows * routing weights, index_add into their tokens (fp32).
Backward: every all-to-all's backward is the reverse all-to-all, so row gradients return to their tokens (and on
to z, the router through the combine weights, the projections) and a replica's weight gradients return to the
owner, where autograd sums them into the owner's shard. Every rank must run the backward of every forward (the
backward holds collectives, as with DDP); the all-to-alls then run in the same order on every rank.

Composed with data and context parallelism (``k3.distributed.plan.ParallelPlan``, ``--dp D --ep R
[--cp C]``): the MoonEP group is one "ep" row of a (dp, ep[, cp]) mesh (under CP each rank dispatches the tokens of its
own time segment), and ``shard_experts_over_dp`` splits each rank's E/R experts once more over its column, the D*C
ranks of the same ep index (all-gathered in the forward, reduce-scattered in the backward, like FSDP).

Legend: N local tokens, k experts per token, E experts, R ranks, r this rank, m = E/R experts per rank,
M = 2m plan entries per rank, T = sum(loads)/R rows computed per rank, L latent width, I expert intermediate,
P = 3*I*L numbers per flattened expert.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import nn

from ..layers.width.latent_moe import ExpertBank, LatentMoE, expert_glu
from ..ops.routing import combine_rows, dispatch_rows, inverse_permutation
from .moonep import PlanArrays, plan_arrays

__all__ = ["parallelize_moe", "shard_experts_over_dp", "unpermute_experts", "ExpertParallelBank", "dispatch_layout",
           "DispatchLayout", "EPStep", "all_to_all"]


# ---------------------------------------------------------------- collectives


def _exchange(x: torch.Tensor, send_splits: list[int], recv_splits: list[int], group) -> torch.Tensor:
    out = x.new_empty((sum(recv_splits), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), recv_splits, send_splits, group=group)
    return out


class _AllToAll(torch.autograd.Function):
    """all_to_all_single with variable splits along dim 0; the backward is the same exchange reversed."""

    @staticmethod
    def forward(ctx, x, send_splits, recv_splits, group):
        ctx.send_splits, ctx.recv_splits, ctx.group = send_splits, recv_splits, group
        return _exchange(x, send_splits, recv_splits, group)

    @staticmethod
    def backward(ctx, grad):
        return _exchange(grad, ctx.recv_splits, ctx.send_splits, ctx.group), None, None, None


def all_to_all(x: torch.Tensor, send_splits: list[int], recv_splits: list[int], group=None) -> torch.Tensor:
    """x [sum(send_splits), ...]: rows [sum(send_splits[:q]), +send_splits[q]) go to rank q; returns
    [sum(recv_splits), ...] with rank s's rows at [sum(recv_splits[:s]), +recv_splits[s]). Differentiable."""
    return _AllToAll.apply(x, list(send_splits), list(recv_splits), group)


class _GatherRows(torch.autograd.Function):
    """x [n,...] (equal n on every rank of ``group``) -> [R*n,...] in group-rank order; backward: the SUM of every
    rank's gradient of the gathered tensor, this rank's rows (a reduce-scatter, as FSDP's)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group, ctx.n = group, x.shape[0]
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        if hasattr(dist, "reduce_scatter_single"):
            out = grad.new_empty((ctx.n, *grad.shape[1:]))
            dist.reduce_scatter_single(out, grad, group=ctx.group)
            return out, None
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)
        r = dist.get_rank(ctx.group)
        return grad[r * ctx.n:(r + 1) * ctx.n], None


def _all_gather_counts(counts_E: torch.Tensor, group) -> torch.Tensor:
    parts = [torch.empty_like(counts_E) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, counts_E.contiguous(), group=group)
    return torch.stack(parts)  # [R,E]


# ---------------------------------------------------------------- the plan, as row movements (pure, no collectives)


class DispatchLayout(NamedTuple):
    """Where every routed slot goes. Plan rows are sorted by expert, padding (expert -1, 0 rows) at the end."""

    plan: PlanArrays  # experts / counts / offsets [R,M]
    pieces: torch.Tensor  # [R,R,M] int64: pieces[s, q, j] = rows of plan entry (q, j) that come from rank s


def dispatch_layout(counts_RE: torch.Tensor) -> DispatchLayout:
    """counts_RE [R,E] (slots per source rank and expert) -> the MoonEP plan of the pooled loads and its pieces."""
    if counts_RE.dim() != 2 or counts_RE.is_floating_point():
        raise ValueError(f"counts_RE must be an integer [R,E] tensor of slot counts; got {counts_RE.dim()}-D "
                         f"{counts_RE.dtype}")
    counts_RE = counts_RE.to(torch.int64).cpu()
    R = counts_RE.shape[0]
    plan = plan_arrays(counts_RE.sum(0), R)
    first_RE = counts_RE.cumsum(0) - counts_RE  # global position of source s's first slot of expert e
    e = plan.experts.clamp(min=0)  # padding entries have 0 rows, so any expert index works for them
    lo, hi = plan.offsets, plan.offsets + plan.counts  # [R,M] the entry's range of its expert's slots
    src_lo = first_RE[:, e]  # [R(src),R(dst),M]
    src_hi = src_lo + counts_RE[:, e]
    pieces = (torch.minimum(src_hi, hi) - torch.maximum(src_lo, lo)).clamp(min=0)
    return DispatchLayout(plan, pieces)


def _send_order(layout: DispatchLayout, r: int, num_experts: int) -> torch.Tensor:
    """Positions, in rank r's expert-sorted slot list, in send order (by destination, then expert, then position)."""
    R = layout.pieces.shape[0]
    dev = layout.pieces.device  # the layout lives on the CPU (dispatch_layout), whatever the default device
    send_QE = torch.zeros(R, num_experts, dtype=torch.int64, device=dev)
    send_QE.scatter_add_(1, layout.plan.experts.clamp(min=0), layout.pieces[r])  # [R(dst),E]
    # an expert's slots go to its entries in rank order (offsets grow with the rank), so in sorted order
    dest = torch.arange(R, device=dev).repeat(num_experts).repeat_interleave(send_QE.T.reshape(-1))
    return dest.argsort(stable=True)


def _arrival_entries(layout: DispatchLayout, r: int) -> torch.Tensor:
    """Plan entry j of every row rank r receives, in arrival order (by source, then entry, then position)."""
    R, _, M = layout.pieces.shape
    return torch.arange(M, device=layout.pieces.device).repeat(R).repeat_interleave(layout.pieces[:, r].reshape(-1))


class _ReplicaExchange(NamedTuple):
    send_local: torch.Tensor  # [n_send] local expert index of every shard row sent, in send order
    send_splits: list[int]  # [R]
    recv_splits: list[int]  # [R]
    pick: torch.Tensor  # [n_entries] row of cat(own shard, received) holding each of rank r's plan entries
    needed: bool  # the plan has a replica on some rank: the same answer on every rank


def _replica_exchange(plan: PlanArrays, r: int, m: int) -> _ReplicaExchange:
    """Which expert weights rank r sends to (and receives from) whom so that every plan entry has its weights."""
    R = plan.experts.shape[0]
    owner = plan.experts.div(m, rounding_mode="floor")  # [R,M], -1 for padding
    replica = (plan.experts >= 0) & (owner != torch.arange(R, device=plan.experts.device)[:, None])
    sent = replica & (owner == r)  # [R(dst),M] entries of other ranks that rank r's shard serves
    send_local = plan.experts[sent] - r * m  # row-major: by destination, then expert
    mine, n = plan.experts[r], int((plan.experts[r] >= 0).sum())
    # received replicas arrive by owner then expert, i.e. in entry order (entries are sorted by expert)
    pick = torch.where(replica[r], m + replica[r].cumsum(0) - 1, mine - r * m)[:n]
    recv_splits = [int((replica[r] & (owner[r] == s)).sum()) for s in range(R)]
    return _ReplicaExchange(send_local, sent.sum(1).tolist(), recv_splits, pick, bool(replica.any()))


# ---------------------------------------------------------------- the module


def _shard(w: torch.Tensor, lo: int, hi: int) -> nn.Parameter:
    return nn.Parameter(w.detach()[lo:hi].clone(), requires_grad=w.requires_grad)


class EPStep(NamedTuple):
    """What the last forward did on this rank (for tests, logs and benchmarks)."""

    layout: DispatchLayout  # plan [R,M] and pieces [R,R,M], the same on every rank
    received_rows: int  # rows this rank computed: sum(loads)/R
    replicas: int  # experts of other ranks this rank hosted


class ExpertParallelBank(nn.Module):
    """This rank's shard of an ExpertBank: w1, w3 [m,I,L], w2 [m,L,I] for the experts [r*m, (r+1)*m).

    ``forward(z, weights, idx)`` has ExpertBank's contract on the LOCAL tokens (idx holds global expert ids) and
    runs the MoonEP dispatch / compute / combine over ``group``; it is a collective: call it on every rank."""

    routed_experts = True  # optimised per expert like ExpertBank

    def __init__(self, bank: ExpertBank, group=None):
        super().__init__()
        E, R, r = bank.w1.shape[0], dist.get_world_size(group), dist.get_rank(group)
        if E % R:
            raise ValueError(f"expert parallelism needs the number of experts E={E} to be a multiple of the group "
                             f"size R={R} (each rank owns E/R contiguous experts); choose R dividing E")
        m = E // R
        self.w1, self.w3, self.w2 = (_shard(w, r * m, (r + 1) * m) for w in (bank.w1, bank.w3, bank.w2))
        self.act, self.b1, self.b2, self.qat = bank.act, bank.b1, bank.b2, bank.qat
        self.num_experts, self.rank, self.world_size, self.group = E, r, R, group
        self.dp_group = None  # set by shard_experts_over_dp: w1/w3/w2 then hold 1/D of the shard each (DTensors),
        # D the size of that column group (dp x cp ranks)
        self.last_step: EPStep | None = None

    def extra_repr(self) -> str:
        m, r = self.num_experts // self.world_size, self.rank
        return f"experts [{r * m}, {(r + 1) * m}) of {self.num_experts}, rank {r} of {self.world_size}"

    @torch.compiler.disable  # host-planned splits and collectives: eager inside a compiled FFN (k3 train --compile)
    def forward(self, z: torch.Tensor, weights: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        """z [N,L], weights/idx [N,k] (this rank's tokens) -> sum_j w_j E_j(z) [N,L] in fp32."""
        k = idx.shape[1]
        r, group = self.rank, self.group
        slots = idx.reshape(-1)
        counts_RE = _all_gather_counts(torch.bincount(slots, minlength=self.num_experts), group)
        layout = dispatch_layout(counts_RE)
        w1, w3, w2, replicas = self._entry_weights(layout.plan)  # [n,I,L], [n,I,L], [n,L,I]

        slot = slots.argsort(stable=True)[_send_order(layout, r, self.num_experts).to(z.device)]  # [N*k] send order
        inverse = inverse_permutation(slot)
        send_splits, recv_splits = layout.pieces[r].sum(1).tolist(), layout.pieces[:, r].sum(1).tolist()
        rows = all_to_all(dispatch_rows(z, slot, inverse, k), send_splits, recv_splits, group)  # [T,L], arrival order
        done = self._compute(rows, _arrival_entries(layout, r).to(z.device), layout.plan.counts[r], w1, w3, w2)
        back = all_to_all(done, recv_splits, send_splits, group)  # [N*k,L], send order
        self.last_step = EPStep(layout, rows.shape[0], replicas)

        return combine_rows(back.float() * weights.reshape(-1)[slot, None], slot, inverse, k)

    def _entry_weights(self, plan: PlanArrays):
        """Weights of this rank's plan entries: its own shard rows, and replicas fetched from their owners."""
        m = self.num_experts // self.world_size
        ex = _replica_exchange(plan, self.rank, m)
        own = self._own_experts()  # [m,P]
        pool = own
        if ex.needed:  # a global decision: every rank joins the exchange or none does
            fetched = all_to_all(own[ex.send_local.to(own.device)], ex.send_splits, ex.recv_splits, self.group)
            pool = torch.cat([own, fetched])
        bank = pool[ex.pick.to(own.device)]  # [n,P]
        I, L = self.w1.shape[1:]
        IL = I * L
        w1, w3, w2 = bank[:, :IL], bank[:, IL:2 * IL], bank[:, 2 * IL:]
        return w1.unflatten(1, (I, L)), w3.unflatten(1, (I, L)), w2.unflatten(1, (L, I)), sum(ex.recv_splits)

    def _own_experts(self) -> torch.Tensor:
        """This rank's m = E/R experts, flattened (w1, w3, w2) rows [m,P]. Sharded over a data-parallel group too
        (``shard_experts_over_dp``): each rank holds m/D of them and the D pieces are all-gathered (differentiable:
        the backward sums the D ranks' gradients into each piece, a reduce-scatter)."""
        ws = (self.w1, self.w3, self.w2)
        if self.dp_group is not None:
            ws = tuple(w.to_local() for w in ws)  # the gradient comes back as a DTensor laid out like the parameter
        own = torch.cat([w.flatten(1) for w in ws], dim=1)
        return _GatherRows.apply(own, self.dp_group) if self.dp_group is not None else own

    def _compute(self, rows, entry, counts_M, w1, w3, w2) -> torch.Tensor:
        """rows [T,L] in arrival order, entry [T] -> the experts' outputs [T,L] in arrival order."""
        group_order = entry.argsort(stable=True)  # by entry (= expert), then source rank, then position
        counts = counts_M[:w1.shape[0]].to(rows.device)
        out = expert_glu(rows[group_order], counts, w1, w3, w2, self.act, self.b1, self.b2, self.qat)
        return out[group_order.argsort()]


def parallelize_moe(moe: LatentMoE, group=None) -> None:
    """Shard ``moe``'s routed experts over ``group`` (default: the world) in place, MoonEP dispatch (SPEC §8).

    Call it on every rank of the group with the same module (same weights, e.g. built from one seed); afterwards
    ``moe.experts`` holds only this rank's E/R experts and the forward and backward are collectives."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("parallelize_moe needs an initialized torch.distributed process group; call "
                           "torch.distributed.init_process_group first")
    if not isinstance(moe, LatentMoE):
        raise TypeError(f"parallelize_moe expects a LatentMoE; got {type(moe).__name__}")
    if isinstance(moe.experts, ExpertParallelBank):
        raise ValueError("this LatentMoE is already expert-parallel; parallelize it once")
    if not isinstance(moe.experts, ExpertBank):
        raise TypeError(f"moe.experts must be an ExpertBank to be sharded; got {type(moe.experts).__name__}")
    moe.experts = ExpertParallelBank(moe.experts, group)


def shard_experts_over_dp(bank: ExpertParallelBank, dp_group, mesh) -> None:
    """Shard an expert-parallel bank's E/R experts once more over ``dp_group``, the D ranks of its column (ZeRO-3 /
    FSDP style, as torchtitan shards experts over the data-parallel ranks left beside EP; with context parallelism
    the column is the dp x cp ranks of one ep index), so that every parameter of the model can live on ONE 1-D
    DeviceMesh ``mesh`` of all D*R ranks (the mesh FSDP shards the other weights over): gradient-norm clipping and
    Muon then see DTensors of a single mesh.

    Ranks are laid out as rank = d * R + ep_index (``mesh`` in rank order), d the rank's index in ``dp_group`` (with
    context parallelism d = dp_index * C + cp_index and rank = (dp_index * R + ep_index) * C + cp_index: the same
    layout). Rank (d, r) keeps experts [r*m + d*c, r*m + (d+1)*c) of the E, c = E/(D*R), as a DTensor Shard(0) of a
    [E, ...] bank on ``mesh``; the DTensor's global view therefore lists the experts in the order of the chunks
    (d, r) by rank, a permutation of the true order (``unpermute_experts`` undoes it). Muon orthogonalises each
    expert on its own and AdamW/weight decay are elementwise, so the permutation changes no update. The forward
    all-gathers the D chunks of the shard over ``dp_group`` (group-rank order is d) before MoonEP's dispatch; the
    backward reduce-scatters (sums over the D ranks)."""
    from torch.distributed.tensor import DTensor, Shard

    D = dist.get_world_size(dp_group)
    m = bank.w1.shape[0]
    if m % D:
        raise ValueError(f"--ep shards each expert-parallel rank's E/ep = {m} experts over the {D} ranks of its column "
                         f"(dp x cp): choose dp x cp dividing E/ep (E = {bank.num_experts})")
    c, d = m // D, dist.get_rank(dp_group)
    for name in ("w1", "w3", "w2"):
        w = getattr(bank, name)
        local = w.detach()[d * c:(d + 1) * c].clone()
        full = (bank.num_experts, *w.shape[1:])
        dt = DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=torch.Size(full),
                                stride=torch.empty(full, device="meta").stride())
        setattr(bank, name, nn.Parameter(dt, requires_grad=w.requires_grad))
    bank.dp_group = dp_group


def unpermute_experts(full: torch.Tensor, dp: int, ep: int) -> torch.Tensor:
    """The [E, ...] global view of a bank sharded by ``shard_experts_over_dp`` (chunks by rank d*ep + r) -> the
    true expert order (chunks by r*dp + d). With context parallelism (C cp ranks, chunks by rank
    (d*ep + r)*C + c, true order (r*dp + d)*C + c) the same call applies: the C chunks of a (d, r) pair are
    adjacent in both orders and move together."""
    return full.reshape(dp, ep, -1, *full.shape[1:]).transpose(0, 1).reshape(full.shape)
