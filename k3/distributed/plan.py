"""One parallel plan for training (SPEC §8): a ("dp", "ep", "cp") mesh whose sizes may be 1, applied from outside.

``ParallelPlan(ParallelDims(dp, ep, cp), device)`` is what ``k3 train --dp D --ep E --cp C`` runs under torchrun
(W = D*E*C processes, rank = (dp_index * E + ep_index) * C + cp_index, the mesh in row-major order); with every
size 1 it is the one-process run. It implements ``k3.train.plan.TrainingPlan`` (as torchtitan's ``ParallelDims``,
one description of the layout from which every group is derived, instead of one class per layout).

Data. The global micro-batch (``batch_slices`` = D*E times --batch-size packed sequences) is cut into S = D*E
equal slices, one per (dp, ep) pair (``rank_slice``: whole samples, so slice boundaries are document
boundaries); the C ranks of a pair's "cp" row split its slice along time (KCP in the KDA layers, gathered MLA
latents, the MTP layers too: ``cp_model_loss``). Every rank dispatches its own tokens to the experts.

Weights. With E > 1 the routed experts are split over the "ep" row (MoonEP dispatch) and each rank's E/ep experts
once more over its column, the D*C ranks of its ep index (``shard_experts_over_dp``); every other weight (every
weight when E = 1) is FSDP2-sharded over all W ranks (torchtitan's "dp_shard_cp", here spanning ep too). Every
parameter is then a DTensor of one 1-D mesh of all ranks: gradient clipping sees the global norm, Muon works
unchanged.

Gradients (the rule of ``k3.train.plan``). One process minimises L = (1/S) sum_s l_s, l_s the slice's token-mean
loss times its share of the global predictions (the shares sum to S). Rank (s, c) computes a share l_{s,c} of its
slice's loss, sum_c l_{s,c} = l_s (``cp_model_loss``; l_{s,1} = l_s without CP), and backpropagates C * l_{s,c}:
the MEAN over the W ranks of what they backpropagate is (C/W) sum_s l_s = L. The CP collectives' backwards (the
latent gather's all-reduce, KCP's adjoint scan, the conv halos) bring every share's gradient back to the rank
that computed the activation, so the ranks' contributions g_r sum to W * grad L:
  - FSDP-sharded weights: FSDP's reduce-scatter averages over the W ranks, which is grad L;
  - experts (E > 1): MoonEP's backward sums the row's contributions into the owner and the column gather's
    backward sums over the column, the sum over all W ranks, which ``reduce_grads`` divides by W.
``mean`` (the average over all W ranks) of the same per-rank parts, detached, gives the logged losses: the
single-process values. Quantile Balancing pools its histograms over the world (the slices are disjoint and the
cp segments tile each slice: every token counted once); QK-clip takes the MAX over the world.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..data.packing import count_targets, media_inputs
from ..ops.varlen import place_cu_seqlens
from ..train.plan import StepLoss
from .context_parallel import cp_model_loss
from .process_group import collective_device, init_from_env, max_logits_across_ranks

__all__ = ["ParallelDims", "ParallelPlan", "PlacedBatch", "rank_slice"]



@dataclass(frozen=True)
class PlacedBatch:
    """One rank's slice of a global batch on its device (``ParallelPlan.place``): ``input_ids`` and ``labels``
    [1, n], ``cu_seqlens`` (its host values remembered, ``k3.ops.varlen.place_cu_seqlens``), ``media`` (the
    vision inputs, as the model takes them), ``shares`` {1: next-token, 2: first MTP} (``rank_slice``) and
    ``tokens``, those of the global batch."""

    input_ids: torch.Tensor
    cu_seqlens: torch.Tensor
    labels: torch.Tensor
    media: dict
    shares: dict
    tokens: int


@dataclass(frozen=True)
class ParallelDims:
    """The sizes of the ("dp", "ep", "cp") mesh; each may be 1."""

    dp: int = 1
    ep: int = 1
    cp: int = 1

    def __post_init__(self):
        for name in ("dp", "ep", "cp"):
            size = getattr(self, name)
            if not isinstance(size, int) or size < 1:
                raise ValueError(f"--{name} must be a positive integer (1 = not split along {name}); got {size!r}")

    @property
    def world(self) -> int:
        return self.dp * self.ep * self.cp

    @property
    def batch_slices(self) -> int:
        """Ranks that train on their own slice of the global batch: every (dp, ep) pair."""
        return self.dp * self.ep

    def check(self, world: int) -> None:
        if world != self.world:
            verb = "is" if world == 1 else "are"
            raise ValueError(f"--dp {self.dp} x --ep {self.ep} x --cp {self.cp} needs {self.world} processes but "
                             f"{world} {verb} running: start them under "
                             f"`torchrun --nproc_per_node {self.world} -m k3 train ...`")


def rank_slice(batch: dict, index: int, slices: int):
    """Slice ``index`` of a packed global batch cut into ``slices`` equal slices: (input_ids [1,n], cu_seqlens,
    labels [1,n] or None, shares), shares[d] = the slice's targets d tokens ahead (d = 1: next token, d = 2: the
    first MTP layer's) * slices / the global batch's. A target is a position whose token d ahead lies in its own
    document (and, with the batch's "labels", is not -100). Sample boundaries are document boundaries, so a slice
    is a whole number of samples. Everything here is on the host (the loader's tensors): no wait for the device."""
    ids, cu, labels = batch["input_ids"], batch["cu_seqlens"], batch.get("labels")
    n = ids.shape[1] // slices
    lo, hi = index * n, (index + 1) * n
    local = cu[(cu >= lo) & (cu <= hi)] - lo
    local_labels = None if labels is None else labels[:, lo:hi]

    shares = {d: count_targets(local, local_labels, d) * slices / max(count_targets(cu, labels, d), 1) for d in (1, 2)}
    return ids[:, lo:hi], local, local_labels, shares


def place_tokens(ids: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Host token ids -> ``device``: on CUDA through pinned memory without blocking (a pageable copy would wait
    for every queued kernel)."""
    if device.type == "cuda" and ids.device.type == "cpu":
        return ids.pin_memory().to(device, non_blocking=True)
    return ids.to(device)


class ParallelPlan:
    """The training loop's ``TrainingPlan`` for any ("dp", "ep", "cp") layout (see the module docstring).

    Construction joins torchrun's process group (``init_from_env``; ``device`` is the TrainConfig's) and builds the
    mesh and its groups: a collective when W > 1, nothing at all when W = 1. ``mesh``: instead, a ("dp", "ep", "cp")
    sub-mesh of a larger mesh (one pipeline stage's ranks, k3.distributed.pipeline_plan); rank and world are then
    this rank's place in it and its size, and every collective stays inside it."""

    def __init__(self, dims: ParallelDims, device: str | torch.device | None = None, mesh=None):
        if mesh is None:
            self.rank, self.world, self.device = init_from_env(device)
        else:
            d, e, c = mesh.get_coordinate()
            self.rank, self.world, self.device = (d * dims.ep + e) * dims.cp + c, mesh.size(), torch.device(device)
        dims.check(self.world)
        self.dims, self.batch_slices = dims, dims.batch_slices
        self.slice, self.cp_rank = self.rank // dims.cp, self.rank % dims.cp
        self._experts: dict[str, torch.nn.Parameter] = {}  # name -> expert bank weight sharded outside FSDP
        self.mesh = self.ep_group = self.cp_group = self.column_group = self.flat = self.group = None
        if self.world > 1:
            from torch.distributed.device_mesh import init_device_mesh

            self.mesh = mesh or init_device_mesh(self.device.type, (dims.dp, dims.ep, dims.cp),
                                                 mesh_dim_names=("dp", "ep", "cp"))
            self.ep_group, self.cp_group = self.mesh["ep"].get_group(), self.mesh["cp"].get_group()
            # the D*C ranks of this rank's ep index (group rank dp_index * C + cp_index): its experts' shards
            self.column_group = self.mesh["dp", "cp"]._flatten("dp_cp").get_group()
            self.flat = self.mesh._flatten("dp_ep_cp")  # all ranks in rank order: FSDP's mesh and the experts'
            self.group = self.flat.get_group() if mesh is not None else None  # None: the whole world

    def shard(self, model) -> None:
        if self.world == 1:
            return
        from torch.distributed.fsdp import fully_shard

        for t in list(model.parameters()) + list(model.buffers()):  # identical replicas before anything is split
            dist.broadcast(t.data, group=self.group, group_src=0)
        ignored = self._shard_experts(model) if self.dims.ep > 1 else set()
        kwargs = {"ignored_params": ignored} if ignored else {}
        for layer in list(model.model.layers) + list(model.mtp):
            fully_shard(layer, mesh=self.flat, **kwargs)
        fully_shard(model, mesh=self.flat, **kwargs)

    def _shard_experts(self, model) -> set:
        from ..layers.width.latent_moe import LatentMoE
        from .expert_parallel import parallelize_moe, shard_experts_over_dp

        moes = [m for m in model.modules() if isinstance(m, LatentMoE)]
        if not moes:
            raise ValueError("--ep needs a model with MoE layers (num_experts > 0)")
        for m in moes:
            parallelize_moe(m, group=self.ep_group)
            shard_experts_over_dp(m.experts, self.column_group, self.flat)
        ids = {id(p) for m in moes for p in m.experts.parameters()}
        self._experts = {n: p for n, p in model.named_parameters() if id(p) in ids}
        return set(self._experts.values())

    def place(self, batch: dict) -> PlacedBatch:
        """This rank's slice of a packed global batch on its device (pinned, non-blocking copies; cu_seqlens' host
        values go with it, so no layer reads it back)."""
        ids, cu, labels, shares = rank_slice(batch, self.slice, self.batch_slices)
        ids, cu = place_tokens(ids, self.device), place_cu_seqlens(cu, self.device)
        labels = ids if labels is None else place_tokens(labels, self.device)  # fine-tuning: -100 = no target
        return PlacedBatch(ids, cu, labels, media_inputs(batch, self.device), shares, batch["input_ids"].numel())

    def loss(self, model, batch: dict, mtp_weight: float, record: tuple[str, ...] = ()) -> StepLoss:
        return self.placed_loss(model, self.place(batch), mtp_weight, record)

    def placed_loss(self, model, placed: PlacedBatch, mtp_weight: float, record: tuple[str, ...] = ()) -> StepLoss:
        """``loss`` of a batch already ``place``d: only device work (what a CUDA graph of the step records)."""
        ids, cu, labels, shares = placed.input_ids, placed.cu_seqlens, placed.labels, placed.shares
        C = self.dims.cp
        if C == 1:
            out = model(ids, cu_seqlens=cu, labels=labels, mtp_weight=mtp_weight, return_logits=False,
                        record=record, **placed.media)
        else:
            T = ids.shape[1]
            n = -(-T // C)
            start, end = min(self.cp_rank * n, T), min((self.cp_rank + 1) * n, T)
            out = cp_model_loss(model, ids, cu, start, end, self.cp_group, mtp=bool(mtp_weight), labels_global=labels,
                                record=record)
        lm, mtp = out["lm_loss"], out.get("mtp_loss")
        lm = lm * (C * shares[1])  # exactly lm in one process (C = 1, shares 1.0)
        stats = {"max_logit": out.get("max_logit"), "routing": out.get("routing")}
        if mtp is None:
            return StepLoss(lm, self.mean(lm.detach()), None, placed.tokens, **stats)
        mtp = mtp * (C * shares[2])
        logged = self.mean(torch.stack([lm.detach(), mtp.detach()]))
        return StepLoss(lm + mtp_weight * mtp, logged[0], logged[1], placed.tokens, **stats)

    def mean(self, x: torch.Tensor) -> torch.Tensor:
        if self.world == 1:
            return x
        t = x.detach().to(collective_device(), torch.float64, copy=True)  # NCCL: stays on the GPU, no wait for it
        dist.all_reduce(t, group=self.group)
        return (t / self.world).to(x.dtype)

    def reduce_grads(self, model) -> None:
        """FSDP already averaged its weights' gradients; the experts hold the sum over all ranks."""
        for p in self._experts.values():
            if p.grad is not None:
                p.grad.div_(self.world)

    def sync_max_logits(self, max_logit: dict) -> None:
        if self.world > 1:
            max_logits_across_ranks(max_logit, self.group)

    def full_state(self, model) -> dict:
        """Full tensors (on CPU, on rank 0; empty elsewhere) of every weight and buffer, experts in their true
        order. Collective: DTensors are gathered one by one in state_dict order on every rank."""
        if self.world == 1:
            return model.state_dict()
        from torch.distributed.tensor import DTensor

        from .expert_parallel import unpermute_experts

        state = {}
        for name, t in model.state_dict().items():
            if isinstance(t, DTensor):
                t = t.full_tensor()
            if name in self._experts:
                t = unpermute_experts(t, self.dims.dp, self.dims.ep)
            if self.rank == 0:
                state[name] = t.detach().cpu()
        return state

    def barrier(self) -> None:
        if self.world > 1:
            dist.barrier(group=self.group)

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
