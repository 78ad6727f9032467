"""What every training command shares (SPEC §4-§5, §8): the model laid out by a parallel plan, Muon/AdamW, the
cosine schedule, Quantile Balancing, QK-clip, gradient clipping, the activation memory policy, and checkpoints.

``k3 train`` / ``k3 sft`` (k3.train.loop) and ``k3 rl`` / ``k3 distill`` (k3.post) differ only in where their
micro-batches come from and which loss they take of them:

    trainer = Trainer(cfg, plan, model, state, saved_steps, log)     # state: a checkpoint's trainer_state or None
    rec = trainer.step(micro_batches, loss_fn)   # loss_fn(model, batch) -> StepLoss; one optimiser step
    trainer.save(run, tokenizer_path, extra, config_json)   # atomic RUN/checkpoint; extra: the caller's own state

``rec`` holds the step's loss (the micro-batches' mean of ``StepLoss.lm_loss``), lr, tokens, gradient norm, MTP
loss, expert load and QK-clip count, as ``k3 train`` logs them.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from pathlib import Path

import torch

from ..pretrained import load_pretrained
from ..config import K3Config
from ..layers.stats import merge_max_logits
from ..model.transformer import K3ForCausalLM
from .balance import ExpertBalancer
from .compile import compile_model
from .graph import StepGraph
from .memory import ActivationManager
from .optim import build_optimizer, clip_coefficient
from .optim.named import is_named, load_named_state, to_named
from .plan import StepLoss
from .qk_clip import qk_clip_
from .schedule import build_scheduler, resume_point
from .state import load_checkpoint, rng_state, save_checkpoint, set_rng_state

__all__ = ["Trainer", "build_model"]


def build_model(mcfg: K3Config, device, resume_from: Path | None = None, init_dir: Path | None = None):
    """-> (model on ``device``, the checkpoint's trainer state or None): resumed from a run's checkpoint (verified
    by ``check_resumable`` before), the weights of ``init_dir`` (fine-tuning), or a fresh initialisation."""
    if resume_from is not None:
        if K3Config.from_hf(resume_from).eos_token_id is None:  # a run begun before eos_token_id was recorded
            mcfg = mcfg.replace(eos_token_id=None)
        model, state = load_checkpoint(resume_from, mcfg, verify=False)
        return model.to(device), state
    if init_dir is not None:
        return load_pretrained(init_dir, config=mcfg, dtype=torch.float32).to(device), None
    return K3ForCausalLM(mcfg).to(device), None


class Trainer:
    """The optimiser side of a run (see the module docstring). ``cfg`` is a ``TrainConfig`` (its optimiser,
    schedule, balancing, QK-clip, memory and compile fields); ``state`` a checkpoint's trainer state to resume
    (optimiser, schedule, balancer, RNG, step, tokens), ``saved_steps`` that run's --steps."""

    def __init__(self, cfg, plan, model, state: dict | None = None, saved_steps: int | None = None, log=print):
        self.cfg, self.plan, self.model = cfg, plan, model
        model.set_kda_backend(cfg.kda_backend)
        if cfg.memory_policy == "recompute" and cfg.cp > 1:
            raise ValueError("--memory-policy recompute (whole layers) does not apply under --cp, whose layers run "
                             "through the context-parallel view; use --memory-policy efficient or offload there")
        self.memory = ActivationManager(cfg.memory_policy)
        # the step as a CUDA graph (k3.train.graph), captured on the first step; refuses what it cannot replay
        self.graph = None  # built below, once the statistics to record are known
        self.memory.attach(model)
        if cfg.compile:
            compile_model(model)
        model.train()
        self.pipelined = getattr(plan, "pipelined", False)  # k3.distributed.pipeline_plan: stages, a schedule
        if self.pipelined and state is not None:  # a numbered (one-process) optimiser state, by name before the cut
            state["optimizer"] = to_named(model, state["optimizer"],
                                          lambda m: build_optimizer(m, lr=cfg.lr, weight_decay=cfg.weight_decay))
        plan.shard(model)  # several processes: experts split, the rest FSDP2-sharded (k3.distributed.plan)
        self.optimizer = build_optimizer(model, lr=cfg.lr, weight_decay=cfg.weight_decay)
        self.resumed_at = None if state is None else resume_point(state, saved_steps, cfg.steps, cfg.warmup_frac,
                                                                  cfg.min_lr_ratio)
        self.scheduler = build_scheduler(self.optimizer, cfg.steps, cfg.warmup_frac, cfg.min_lr_ratio, self.resumed_at)
        from ..layers.width.latent_moe import LatentMoE

        has_experts = any(isinstance(m, LatentMoE) for m in model.modules())  # (a pipeline stage may hold none)
        self.balancing = cfg.balance != "none" and bool(model.config.num_experts)
        self.balancer = ExpertBalancer(model, method=cfg.balance, group=getattr(plan, "balance_group", None)) \
            if self.balancing and has_experts else None
        # the statistics the step's forwards return (k3.layers.stats): QK-clip's max logits, the balancer's routing
        self.record = (("max_logit",) if cfg.qk_clip_tau else ()) + (("routing",) if self.balancer is not None else ())
        if cfg.cuda_graph:
            self.graph = StepGraph(model, plan, self.memory, cfg.mtp_weight, cfg.grad_accum, self.record)
        self.step_count, self.tokens = 0, 0
        if state is not None:
            if is_named(state["optimizer"]):  # written under another layout (k3.train.optim.named)
                load_named_state(model, self.optimizer, state["optimizer"])
            else:
                self.optimizer.load_state_dict(state["optimizer"])
            sched = state["scheduler"]
            if is_named(state["optimizer"]):  # another layout's optimiser may have had other groups: one lr for all
                n = len(self.optimizer.param_groups)
                sched = {**sched, "base_lrs": sched["base_lrs"][:1] * n, "_last_lr": sched["_last_lr"][:1] * n,
                         "lr_lambdas": [{} for _ in range(n)]}
            self.scheduler.load_state_dict(sched)
            if self.balancer is not None:
                pick = getattr(plan, "stage_balancer_state", None)  # a pipeline stage's MoE layers of every layer's
                self.balancer.load_state_dict(pick(state["balancer"]) if pick else state["balancer"])
            set_rng_state(state["rng"])
            self.step_count, self.tokens = state["step"], state["tokens"]
        device = plan.device
        self.amp = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else nullcontext()

    def default_loss(self, model, batch: dict) -> StepLoss:
        """Next-token (+ MTP) cross-entropy of a packed batch (its "labels", -100 = no target, when it has them), with
        the statistics QK-clip and the balancer need."""
        return self.plan.loss(model, batch, self.cfg.mtp_weight, self.record)

    def step(self, micro_batches: Sequence[dict], loss_fn: Callable[..., StepLoss] | None = None,
             measure: bool = False) -> dict:
        """One optimiser step over ``micro_batches`` (gradients accumulated, each micro-batch's loss divided by
        their number). ``measure``: record what the first micro-batch's forward saved for the backward (under
        ``cuda_graph``: what the capture's warm-up forward saved, the same layout's). Under ``cfg.cuda_graph`` the
        micro-batches' forwards and backwards are replays of one captured graph (``k3.train.graph``)."""
        graphed = self.cfg.cuda_graph
        if graphed and loss_fn is not None:
            raise ValueError("--cuda-graph captures the default loss only (a caller's loss function may read the "
                             "device or change with the step): leave loss_fn out or drop --cuda-graph")
        loss_fn = loss_fn or self.default_loss
        model, n = self.model, len(micro_batches)
        if graphed and n != self.graph.micro_batches:
            raise ValueError(f"--cuda-graph: this step has {n} micro-batches, the captured step "
                             f"{self.graph.micro_batches}; keep --grad-accum fixed")
        loss_sum, mtp_sum, first_saved, peaks, max_logit = 0.0, 0.0, None, None, None
        if self.pipelined:  # the schedule runs every micro-batch's forward and backward (k3.distributed.pipeline_plan)
            with self.amp, self.memory.forward(measure=measure) as saved:
                lm, mtp, tokens, peaks, max_logit = self.plan.pipeline_step(
                    model, micro_batches, self.cfg.mtp_weight, self.record,
                    self.balancer.observe if self.balancer else None, saved if measure else None)
            loss_sum, mtp_sum, micro_batches = lm, (mtp if mtp is not None else 0.0), []
            first_saved = max(peaks) if peaks else None  # the most any pipeline rank held at once
            self.tokens += tokens
        for i, batch in enumerate(micro_batches):
            if graphed:
                res = self.graph.run(batch, i)
            else:
                with self.amp, self.memory.forward(measure=measure and i == 0) as saved:
                    res = loss_fn(model, batch)
                if i == 0:
                    first_saved = saved.kept_bytes
                (res.loss / n).backward()
            loss_sum += res.lm_loss / n
            mtp_sum += (res.mtp_loss if res.mtp_loss is not None else 0.0) / n
            if self.balancer is not None and res.routing is not None:  # (a caller's loss may return none)
                self.balancer.observe(res.routing)  # before a graph's next replay rewrites it, in stream order
            max_logit = merge_max_logits(max_logit, res.max_logit)
            self.tokens += res.tokens
        self.plan.reduce_grads(model)
        # clipping's factor is applied inside the optimiser's passes (no pass of its own over the gradients)
        grad_norm, coef = getattr(self.plan, "clip_coefficient", clip_coefficient)(model.parameters(), self.cfg.grad_clip)
        lr = self.optimizer.param_groups[0]["lr"]
        self.optimizer.step(scale=coef)
        self.scheduler.step()
        if not graphed:  # a graph's gradients are its own memory, written afresh by every replay
            self.optimizer.zero_grad(set_to_none=True)
        # QK-clip and the router biases queued on the device too, then one read of the device per step, behind
        # all of it (a read before them would leave the device idle while the host launches them, and a read of
        # its own for each would idle it three times); a non-finite loss stops the run before anything of this
        # step is saved
        if self.cfg.qk_clip_tau and max_logit:
            self.plan.sync_max_logits(max_logit)
        clipped = qk_clip_(model, max_logit, self.cfg.qk_clip_tau) if self.cfg.qk_clip_tau else None
        load = self.balancer.update() if self.balancer is not None else None
        figures = {"loss": loss_sum, "mtp": mtp_sum, "grad_norm": grad_norm,
                   "clipped": 0 if clipped is None else clipped}
        dev = grad_norm.device  # the figures already there are read together; host numbers stay as they are
        read = [k for k, x in figures.items() if isinstance(x, torch.Tensor) and x.device == dev]
        values = torch.cat([figures[k].double().reshape(-1) for k in read]
                           + ([load.reshape(-1)] if load is not None else [])).tolist()
        figures.update(zip(read, values))
        loss_sum, mtp_sum, grad_norm = (float(figures[k]) for k in ("loss", "mtp", "grad_norm"))
        clipped = int(figures["clipped"])
        if not math.isfinite(loss_sum):
            raise FloatingPointError(f"loss became {loss_sum} at step {self.step_count}; lower --lr or check the data")
        pairs = [values[i:i + 2] for i in range(len(read), len(values), 2)]
        if self.pipelined and self.balancing:  # every stage's layers, for the log
            pairs = self.plan.gather_loads(pairs)
            load = pairs or None
        if load is not None:
            load = ExpertBalancer.load_stats(pairs)
        self.step_count += 1
        rec = {"step": self.step_count, "loss": loss_sum, "lr": lr, "tokens": self.tokens, "grad_norm": grad_norm}
        if graphed:
            rec["cuda_graph_captures"] = self.graph.captures
        if measure:  # what the first micro-batch's forward left for its backward on the device (k3.train.memory)
            rec["saved_activation_bytes"] = self.graph.saved_activation_bytes if graphed else first_saved
            if peaks:  # per pipeline rank: its stages' saved activations at their peak (several micro-batches)
                rec["pp_saved_activation_bytes"] = peaks
        if mtp_sum:
            rec["mtp_loss"] = mtp_sum
        if load is not None:
            rec["load_max_over_mean"] = load["load_max_over_mean"]
            rec["load_per_layer"] = load["per_layer"]
        if clipped:
            rec["qk_clipped_heads"] = clipped
        return rec

    def save(self, run: Path, tokenizer_path: Path, extra: dict, config_json: dict) -> Path:
        """Write RUN/checkpoint atomically (collective under several processes): the model, the tokenizer and the
        trainer state (optimiser, schedule, balancer, RNG, step, tokens) plus ``extra`` (the caller's own: a data
        cursor, rollout buffers, ...)."""
        state = {"scheduler": self.scheduler.state_dict(), "step": self.step_count, "tokens": self.tokens,
                 "rng": rng_state(), "balancer": self.balancer.state_dict() if self.balancer is not None else None,
                 "schedule": {"total_steps": self.cfg.steps, "resumed_at": self.resumed_at}, **extra}
        parts = getattr(self.plan, "checkpoint_parts", None)
        if parts is not None:  # pipeline stages: rank 0 gets every stage's balancer (and optimiser, by name)
            entries, shard = parts(self.model, self.optimizer, self.balancer)
            return save_checkpoint(run, self.model, tokenizer_path, {**state, **entries}, config_json,
                                   model_state=self.plan.full_state(self.model), optimizer_shard=shard)
        if self.plan.world == 1:
            return save_checkpoint(run, self.model, tokenizer_path, {**state, "optimizer": self.optimizer.state_dict()},
                                   config_json)
        return save_checkpoint(run, self.model, tokenizer_path, state, config_json,
                               model_state=self.plan.full_state(self.model), optimizer_shard=self.optimizer.state_dict())
