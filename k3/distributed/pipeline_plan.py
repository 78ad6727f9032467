"""Pipeline parallelism over a ("pp", "dp", "ep", "cp") mesh (SPEC §8), on ``torch.distributed.pipelining``.

``PipelinePlan(ParallelDims(dp, ep, cp), PipelineDims(pp, schedule, virtual, layers), device, grad_accum, seq_len)``
is what ``k3 train --pp N`` runs: W = pp x dp x ep x cp processes, rank = ((pp_i * D + dp_i) * E + ep_i) * C + cp_i.
Each pp index is one pipeline rank; its D*E*C ranks form a ``ParallelPlan`` of their own (k3.distributed.plan:
FSDP2, MoonEP inside the stage, every collective inside it), holding the same stages. The model's decoder layers
are cut into pp x V stages (``pipeline.split_layers``: the cost model, or --pp-layers); stage s runs on pipeline
rank s % pp (1F1B, interleaved 1F1B) or in a V (zero-bubble: ZBV, stages r and 2pp-1-r). The step's --grad-accum
micro-batches are the schedule's micro-batches (``scale_grads``: each micro-batch's gradient / M, as the one-process
loop's (loss / M).backward()).

Why the engine carries AttnRes: stage boundaries have fixed shapes per micro-batch (pipeline.pack: the depth
sources [n + 1 + M, B, T, D]), and what does not travel (document boundaries, targets, shares) is looked up by the
micro-batch index passed as a keyword to every stage.

Per step: the loss parts live on the last stage, summed over the pp group (zeros elsewhere) after the stage group's
mean; the gradient norm is sqrt(sum over pp of each stage's squared norm); QK-clip's MAX and Quantile Balancing's
histograms stay inside the stage group (each layer lives on one stage); the load statistics are gathered over pp
for the log. Checkpoints: rank 0 writes the whole model, and with dp = ep = cp = 1 the optimiser state by parameter
name (``k3.train.optim.named``) and the balancer for every MoE layer, so a checkpoint of one pp layout resumes
under any other, or in one process; with dp/ep/cp inside a stage each rank adds its optimiser shard (same layout).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from ..train.plan import StepLoss
from .pipeline import StageModule, StepFeed, sources_at, split_layers
from .plan import ParallelDims, ParallelPlan
from .process_group import collective_device, init_from_env

__all__ = ["PipelineDims", "PipelinePlan", "SCHEDULES"]

SCHEDULES = ("1f1b", "interleaved", "zero-bubble")


@dataclass(frozen=True)
class PipelineDims:
    pp: int = 1
    schedule: str = "1f1b"
    virtual: int | None = None  # stages per pipeline rank; None: 1 for 1f1b, 2 otherwise
    layers: tuple[int, ...] | None = None  # decoder layers per stage (--pp-layers); None: the cost model

    def __post_init__(self):
        if self.schedule not in SCHEDULES:
            raise ValueError(f"--pp-schedule {self.schedule!r}: expected one of {', '.join(SCHEDULES)}")
        v = self.stages_per_rank
        if self.schedule == "1f1b" and v != 1:
            raise ValueError(f"--pp-virtual {v}: 1f1b runs one stage per rank; use --pp-schedule interleaved")
        if self.schedule == "zero-bubble" and v != 2:
            raise ValueError(f"--pp-virtual {v}: zero-bubble (ZBV) runs exactly 2 stages per rank in a V; leave "
                             "--pp-virtual out or pass 2")
        if self.pp < 1 or v < 1:
            raise ValueError(f"--pp and --pp-virtual must be >= 1; got {self.pp}, {v}")

    @property
    def stages_per_rank(self) -> int:
        return self.virtual or (1 if self.schedule == "1f1b" else 2)

    @property
    def stages(self) -> int:
        return self.pp * self.stages_per_rank

    def stage_ranks(self) -> list[int]:
        """The pipeline rank of each stage: looped, or a V for zero-bubble."""
        P, S = self.pp, self.stages
        if self.schedule != "zero-bubble":
            return [s % P for s in range(S)]
        return [s if s < P else 2 * P - 1 - s for s in range(S)]


class PipelinePlan:
    """The training loop's plan for pp > 1 (see the module docstring); ``pipelined`` tells the Trainer to run its
    micro-batches through ``pipeline_step``."""

    pipelined = True

    def __init__(self, dims: ParallelDims, pipe: PipelineDims, device=None, grad_accum: int = 1, seq_len: int = 512,
                 batch_size: int = 1):
        from torch.distributed.device_mesh import init_device_mesh

        if dims.cp > 1:
            raise ValueError("--pp with --cp is not built yet (the stages would run cp_model_loss's context-parallel "
                             "view); run --pp with --dp and/or --ep, or --cp without --pp")
        self.rank, self.world, self.device = init_from_env(device)
        need = pipe.pp * dims.world
        if self.world != need:
            raise ValueError(f"--pp {pipe.pp} x --dp {dims.dp} x --ep {dims.ep} x --cp {dims.cp} needs {need} processes "
                             f"but {self.world} are running: start them under `torchrun --nproc_per_node {need} -m k3 "
                             "train ...`")
        if grad_accum < pipe.stages and pipe.schedule == "1f1b":
            raise ValueError(f"--grad-accum {grad_accum}: 1F1B needs at least as many micro-batches as stages "
                             f"({pipe.stages}); raise --grad-accum")
        if pipe.schedule == "interleaved" and grad_accum % pipe.pp:
            raise ValueError(f"--grad-accum {grad_accum}: interleaved 1F1B needs a multiple of --pp {pipe.pp}")
        self.dims, self.pipe, self.grad_accum, self.seq_len = dims, pipe, grad_accum, seq_len
        self.tokens = batch_size * seq_len  # one micro-batch of one (dp, ep) slice: [1, tokens]
        self.mesh = init_device_mesh(self.device.type, (pipe.pp, dims.dp, dims.ep, dims.cp),
                                     mesh_dim_names=("pp", "dp", "ep", "cp"))
        self.pp_rank = self.mesh.get_coordinate()[0]
        self.pp_group = self.mesh["pp"].get_group()
        sub = self.mesh["dp", "ep", "cp"]
        self.stage_group = sub._flatten("stage").get_group()  # this rank's stage ranks (size 1 without dp/ep/cp)
        self.inner = ParallelPlan(dims, self.device, mesh=sub)
        self.batch_slices = self.inner.batch_slices
        self.balance_group = self.stage_group
        self.feed = StepFeed()
        self.stages: list[StageModule] = []
        self.moe_index: list[int] = []  # the full model's MoE-layer index of each MoE this rank holds, in order

    # layout

    def shard(self, model) -> None:
        from ..layers.width.latent_moe import LatentMoE

        c = model.config
        bounds = split_layers(c, self.pipe.stages, self.seq_len, list(self.pipe.layers) if self.pipe.layers else None)
        owner = self.pipe.stage_ranks()
        mine = [s for s in range(self.pipe.stages) if owner[s] == self.pp_rank]
        self.first_here, self.last_here = 0 in mine, self.pipe.stages - 1 in mine
        self.layout = bounds
        for t in list(model.parameters()) + list(model.buffers()):  # identical replicas before anything is cut
            dist.broadcast(t.data, src=0)
        moes = [m for m in model.modules() if isinstance(m, LatentMoE)]
        self.stages = [StageModule(model, *bounds[s], s == 0, s == self.pipe.stages - 1, self.feed, mtp=True)
                       for s in mine]
        held = {id(m) for st in self.stages for m in st.modules()}
        self.moe_index = [i for i, m in enumerate(moes) if id(m) in held]
        _prune(model, held)
        if self.inner.world > 1:
            self._shard_stages(model)
        self._build_schedule(mine, bounds, c)

    def _shard_stages(self, model) -> None:
        from torch.distributed.fsdp import fully_shard

        ignored = self.inner._shard_experts(model) if self.dims.ep > 1 else set()
        kwargs = {"ignored_params": ignored} if ignored else {}
        for st in self.stages:
            for layer in list(st.layers) + list(st.mtp if getattr(st, "mtp", None) is not None else []):
                fully_shard(layer, mesh=self.inner.flat, **kwargs)
            fully_shard(st, mesh=self.inner.flat, **kwargs)

    def _build_schedule(self, mine: list[int], bounds, config) -> None:
        from torch.distributed.pipelining import (PipelineStage, Schedule1F1B, ScheduleInterleaved1F1B,
                                                  ScheduleZBVZeroBubble)

        S = self.pipe.stages
        stages = [PipelineStage(st, s, S, self.device, input_args=self._example(config, bounds[s][0], s == 0),
                                output_args=self._example(config, bounds[s][1], s == S - 1, out=True),
                                group=self.pp_group) for st, s in zip(self.stages, mine)]
        feed = self.feed

        def loss_fn(out, target):  # out: the last stage's [1, 2] weighted (lm, mtp) of one micro-batch
            return out[0, 0] + feed.mtp_weight * out[0, 1]

        if self.pipe.schedule == "1f1b":
            self.schedule = Schedule1F1B(stages[0], self.grad_accum, loss_fn=loss_fn)
        elif self.pipe.schedule == "interleaved":
            self.schedule = ScheduleInterleaved1F1B(stages, self.grad_accum, loss_fn=loss_fn)
        else:
            self.schedule = ScheduleZBVZeroBubble(stages, self.grad_accum, loss_fn=loss_fn)

    def _example(self, config, layer: int, end: bool, out: bool = False) -> torch.Tensor:
        """A stage's input (``out``: output) as the schedule must expect it, on the meta device: the engine's
        static mode. (Without it the engine infers shapes by running each stage once on uninitialised buffers,
        which would feed garbage to Quantile Balancing's and QK-clip's statistics.)"""
        meta = torch.device("meta")
        if end and not out:
            return torch.empty(1, self.tokens, dtype=torch.long, device=meta)  # the first stage's token ids
        if end:
            return torch.empty(1, 2, device=meta)  # the last stage's weighted (lm, mtp) losses
        dtype = torch.bfloat16 if self.device.type == "cuda" else torch.float32  # the depth stream's (autocast)
        n = sources_at(config, layer) + self.stages[0].n_mtp
        return torch.empty(n, 1, self.tokens, config.hidden_size, dtype=dtype, device=meta, requires_grad=True)

    # the step

    def place(self, batch: dict):
        return self.inner.place(batch)

    def pipeline_step(self, model, micro_batches, mtp_weight: float, record=(), observe=None, saved=None):
        """Every micro-batch forward and backward through the schedule -> (lm, mtp, tokens, peaks, max_logit): the
        step's mean losses of the global batch (detached 0-d tensors, the same on every rank; mtp None without MTP),
        its tokens, with ``saved`` (the step's ``k3.train.memory.SavedStats``) each pipeline rank's peak of saved
        activation bytes (read after every stage forward; weights excluded), else None, and with "max_logit" in
        ``record`` this stage's MLA layers' per-head maxima over the step ({layer: [H]}, k3.layers.stats).
        ``observe``: called with each stage forward's routing (the balancer's observe) when ``record`` has
        "routing"."""
        placed = [self.inner.place(b) for b in micro_batches]
        M = len(placed)
        f = self.feed
        f.batches, f.mtp_weight, f.parts, f.observe = placed, mtp_weight, {}, observe
        f.peak, f.saved, f.record, f.max_logit = 0, saved, tuple(record), None
        mb = torch.arange(M, device=self.device).reshape(M, 1)
        args = (torch.cat([p.input_ids for p in placed]),) if self.first_here else ()
        target = mb if self.last_here else None  # (unused by loss_fn: the last stage's output is the loss)
        self.schedule.step(*args, target=target, mb=mb)
        parts = torch.zeros(2, dtype=torch.float64, device=self.device)
        if self.last_here:
            parts = torch.cat([f.parts[i] for i in range(M)]).double().mean(0)
        parts = self.inner.mean(parts) if self.inner.world > 1 else parts
        parts = parts.to(collective_device(self.pp_group))
        dist.all_reduce(parts, group=self.pp_group)  # only the last stage's are non-zero
        max_logit = f.max_logit
        f.batches, f.parts, f.observe, f.saved, f.record, f.max_logit = [], {}, None, None, (), None
        mtp = parts[1].float() if model.config.num_nextn_predict_layers and mtp_weight else None
        peaks = None
        if saved is not None:
            peaks = [None] * self.pipe.pp
            dist.all_gather_object(peaks, f.peak, group=self.pp_group)
        return parts[0].float(), mtp, placed[0].tokens * M, peaks, max_logit

    def loss(self, model, batch: dict, mtp_weight: float) -> StepLoss:
        raise RuntimeError("under --pp the loss of a micro-batch is the pipeline's (pipeline_step): no stage holds "
                           "the whole model")

    placed_loss = loss

    def reduce_grads(self, model) -> None:
        self.inner.reduce_grads(model)

    def clip_coefficient(self, params, max_norm: float):
        """(the global gradient norm over every stage, clipping's coefficient): sqrt(sum_pp ||g_stage||^2)."""
        from torch.distributed.tensor import DTensor

        grads = [p.grad for p in params if p.grad is not None]
        local = torch.nn.utils.get_total_norm(grads, 2.0) if grads else torch.zeros((), device=self.device)
        local = local.full_tensor() if isinstance(local, DTensor) else local
        sq = (local.double() ** 2).to(collective_device(self.pp_group))
        dist.all_reduce(sq, group=self.pp_group)
        norm = sq.sqrt().to(local.device, local.dtype)
        return norm, (max_norm / (norm + 1e-6)).clamp(max=1.0)

    def gather_loads(self, pairs: list) -> list:
        """Each rank's MoE layers' [count, max/mean] -> the full model's list in layer order (over pp)."""
        got = [None] * self.pipe.pp
        dist.all_gather_object(got, (self.moe_index, pairs), group=self.pp_group)
        full = {}
        for index, ps in got:
            full.update(zip(index, ps))
        return [full[i] for i in sorted(full)]

    def evaluate(self, model, dataset, batch_size: int, max_batches: int, device, amp) -> float:
        from .pipeline_eval import pipeline_evaluate

        return pipeline_evaluate(self, model, dataset, batch_size, max_batches, device, amp)

    def mean(self, x: torch.Tensor) -> torch.Tensor:
        t = x.detach().to(collective_device(), torch.float64, copy=True)
        dist.all_reduce(t)
        return (t / self.world).to(x.dtype)

    def sync_max_logits(self, max_logit: dict) -> None:
        self.inner.sync_max_logits(max_logit)  # over this stage's data-parallel ranks: the same layers there

    # checkpoints

    def _to_rank0(self, obj):
        """``obj`` of every stage's first rank -> the list of them on global rank 0 (None elsewhere)."""
        if self.inner.rank != 0:
            return None
        got = [None] * self.pipe.pp if self.rank == 0 else None
        dist.gather_object(obj, got, group=self.pp_group, group_dst=0)
        return got

    def full_state(self, model) -> dict:
        """Every stage's gathered weights, merged on rank 0 (collective)."""
        got = self._to_rank0(self.inner.full_state(model))
        return {k: v for part in got for k, v in part.items()} if got else {}

    def checkpoint_parts(self, model, optimizer, balancer) -> tuple[dict, dict | None]:
        """-> (trainer-state entries for rank 0: "optimizer" by name when each stage is one rank, "balancer" over
        every MoE layer; this rank's optimiser shard or None). Collective."""
        from ..train.optim.named import named_state

        bal = None if balancer is None else balancer.state_dict()
        got = self._to_rank0((self.moe_index, bal, named_state(model, optimizer) if self.inner.world == 1 else None))
        if not got:
            return {}, (optimizer.state_dict() if self.inner.world > 1 else None)
        out = {"balancer": _merge_balancers([(i, b) for i, b, _ in got])}
        if self.inner.world == 1:
            out["optimizer"] = {"format": "by_name", "state": {k: v for _, _, o in got for k, v in o["state"].items()},
                                "groups": {k: v for _, _, o in got for k, v in o["groups"].items()}}
        return out, (optimizer.state_dict() if self.inner.world > 1 else None)

    def stage_balancer_state(self, state: dict | None) -> dict | None:
        """A checkpoint's balancer state (every MoE layer) -> this rank's layers'."""
        if state is None or len(state["loads"]) == len(self.moe_index):
            return state
        pick = lambda xs: [xs[i] for i in self.moe_index]  # noqa: E731
        bounds = state.get("bounds")
        return {**state, "hist": pick(state["hist"]), "loads": pick(state["loads"]),
                "bounds": None if bounds is None else bounds[self.moe_index]}

    def barrier(self) -> None:
        dist.barrier()

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


def _merge_balancers(parts: list) -> dict | None:
    """[(MoE indices, a stage's balancer state)] -> one state over every MoE layer, in layer order."""
    parts = [(i, b) for i, b in parts if b is not None]
    if not parts:
        return None
    hist, loads, bounds = {}, {}, {}
    for index, b in parts:
        for j, l in enumerate(index):
            hist[l], loads[l] = b["hist"][j], b["loads"][j]
            if b.get("bounds") is not None:
                bounds[l] = b["bounds"][j]
    order = sorted(loads)
    return {**parts[0][1], "hist": [hist[l] for l in order], "loads": [loads[l] for l in order],
            "bounds": torch.stack([bounds[l] for l in order]) if len(bounds) == len(order) else None}


def _prune(model, held: set) -> None:
    """Drop what this rank's stages do not hold: other decoder layers become Identity placeholders (the kept ones
    keep their indices, hence their checkpoint names), an unheld embedding, norm, head, output query or MTP None."""
    inner = model.model
    for i, layer in enumerate(inner.layers):
        if id(layer) not in held:
            inner.layers[i] = nn.Identity()
    for owner, name in ((inner, "embed_tokens"), (inner, "norm"), (model, "lm_head"),
                        (inner, "output_attn_res_proj"), (inner, "output_attn_res_norm")):
        m = getattr(owner, name, None)
        if m is not None and id(m) not in held:
            setattr(owner, name, None)
    if len(model.mtp) and id(model.mtp[0]) not in held:
        model.mtp = nn.ModuleList()
