"""The training loop: data -> K3ForCausalLM -> Muon/AdamW, Quantile Balancing, QK-clip, checkpoints (SPEC §4-§5).

``train(TrainConfig(...))`` is what ``k3 train`` and ``k3 demo`` run. One optimiser step = ``grad_accum``
micro-batches of ``batch_size`` packed sequences of ``seq_len`` tokens (documents delimited by cu_seqlens).
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

import torch

from ..config import K3Config
from ..data import (PackedDataset, encode_documents, eos_id, leading_documents, load_documents, load_tokenizer,
                    save_tokenizer, split_documents, stdlib_documents, train_tokenizer, unigram_entropy)
from ..model.transformer import K3ForCausalLM
from .balance import ExpertBalancer
from .compile import compile_model
from .memory import ActivationManager
from .metrics import MetricsLog, Progress
from .optim import build_optimizer
from .plan import TrainingPlan
from .qk_clip import enable_max_logit_tracking, qk_clip_
from .schedule import build_scheduler
from .state import find_checkpoint, load_checkpoint, rng_state, save_checkpoint, set_rng_state


@dataclass(frozen=True)
class TrainConfig:
    out: str
    preset: str | None = "tiny"
    config: str | None = None  # an HF config.json; overrides preset
    data: str | None = None  # text file, directory or JSONL; None = the embedded standard-library corpus
    data_max_bytes: int | None = None  # cap on corpus bytes read (None = all)
    tokenizer_bytes: int = 5_000_000  # bytes of training text the BPE is learned from
    vocab_size: int = 4096
    steps: int = 1000
    batch_size: int = 8  # sequences per micro-batch
    seq_len: int = 512
    grad_accum: int = 1
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_frac: float = 0.01
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    balance: str = "quantile"  # quantile | sign | none
    mtp_weight: float = 0.3
    qk_clip_tau: float | None = 100.0
    eval_every: int = 100
    eval_batches: int = 8
    log_every: int = 10
    save_every: int = 500
    seed: int = 0
    device: str = "auto"
    kda_backend: str = "auto"
    memory_policy: str = "keep"  # keep | efficient | offload | recompute (k3.train.memory)
    compile: bool = False  # regional torch.compile (k3.train.compile)
    val_fraction: float = 0.05
    stop_after: int | None = None  # stop (with a checkpoint) after this step; rerun the same command to resume
    dp: int = 1  # data-parallel ranks (FSDP2) when run under torchrun; batch_size is per rank
    cp: int = 1  # context-parallel ranks: every sequence is split along time over them (KCP + gathered MLA)
    ep: int = 1  # expert-parallel ranks: routed experts sharded, MoonEP-balanced all-to-all dispatch

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


def _quiet(*args, **kwargs) -> None:
    pass


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def _documents(cfg: TrainConfig):
    docs = stdlib_documents(cfg.data_max_bytes) if cfg.data is None else load_documents(cfg.data)
    if cfg.data is not None and cfg.data_max_bytes:
        docs = leading_documents(docs, cfg.data_max_bytes)
    return docs


def _tokenizer(cfg: TrainConfig, train_docs, run: Path, resume_from: Path | None):
    if resume_from is not None:
        tok = load_tokenizer(resume_from / "tokenizer.json")
        if not (run / "tokenizer.json").exists():
            save_tokenizer(tok, run / "tokenizer.json")
        return tok
    # learn the BPE on a prefix of the training split (deterministic)
    tok = train_tokenizer(leading_documents(train_docs, cfg.tokenizer_bytes), cfg.vocab_size)
    save_tokenizer(tok, run / "tokenizer.json")
    return tok


def _model_config(cfg: TrainConfig, vocab: int) -> K3Config:
    base = K3Config.from_hf(cfg.config) if cfg.config else K3Config.preset(cfg.preset)
    return base.replace(vocab_size=vocab)


@torch.no_grad()
def evaluate(model, dataset: PackedDataset, batch_size: int, max_batches: int, device, amp) -> float:
    """Mean next-token loss over the first ``max_batches`` validation batches (token-weighted)."""
    was = model.training
    model.eval()
    total, n = 0.0, 0
    for i, b in enumerate(dataset.eval_batches(batch_size)):
        if i >= max_batches:
            break
        ids, cu = b["input_ids"].to(device), b["cu_seqlens"].to(device)
        with amp:
            loss = model(ids, cu_seqlens=cu, labels=ids, mtp_weight=0.0, return_logits=False)["lm_loss"]
        count = ids.numel() - (cu.numel() - 1)  # positions that predict a token of their own document
        total, n = total + loss.item() * count, n + count
    model.train(was)
    return total / max(n, 1)


def train(cfg: TrainConfig, plan: TrainingPlan, log=print) -> dict:
    """Run (or resume) training under ``plan``, the run's layout over processes (one process:
    ``k3.distributed.plan.ParallelPlan(ParallelDims(), cfg.device)``)."""
    run = Path(cfg.out)
    rank, world = plan.rank, plan.world
    if world != cfg.dp * cfg.cp * cfg.ep:
        raise ValueError(f"--dp {cfg.dp} x --cp {cfg.cp} x --ep {cfg.ep} ranks but {world} process(es) are running: "
                         f"start them under `torchrun --nproc_per_node N -m k3 train ...` with N = dp x cp x ep")
    if rank == 0:
        run.mkdir(parents=True, exist_ok=True)
    plan.barrier()
    device = plan.device
    if rank != 0:
        log = _quiet
    resume_from = find_checkpoint(run)
    if resume_from is not None:
        saved = json.loads((resume_from / "train_config.json").read_text())
        changed = {k for k in ("preset", "config", "data", "data_max_bytes", "vocab_size", "seq_len", "batch_size",
                               "grad_accum", "steps", "lr", "seed") if saved.get(k) != getattr(cfg, k)}
        if changed:
            raise ValueError(f"{resume_from} was written by a run with different {sorted(changed)}; "
                             f"resume with the same settings or use a new --out directory")

    docs = _documents(cfg)
    train_docs, val_docs = split_documents(docs, cfg.val_fraction, cfg.seed)
    tok = _tokenizer(cfg, train_docs, run, resume_from) if rank == 0 else None
    plan.barrier()
    if tok is None:  # the other ranks read the tokenizer rank 0 trained (or the checkpoint's)
        tok = load_tokenizer((resume_from or run) / "tokenizer.json")
    eos = eos_id(tok)
    train_ids, val_ids = encode_documents(tok, train_docs), encode_documents(tok, val_docs)
    train_set = PackedDataset(train_ids, cfg.seq_len, eos, shuffle_seed=cfg.seed)
    val_set = PackedDataset(val_ids, cfg.seq_len, eos, shuffle_seed=None)
    entropy = unigram_entropy(val_set.tokens)
    mcfg = _model_config(cfg, tok.get_vocab_size())

    torch.manual_seed(cfg.seed)
    if resume_from is not None:
        model, state = load_checkpoint(resume_from, mcfg)
        model.to(device)
    else:
        model, state = K3ForCausalLM(mcfg).to(device), None
    model.set_kda_backend(cfg.kda_backend)
    if cfg.memory_policy == "recompute" and cfg.cp > 1:
        raise ValueError("--memory-policy recompute (whole layers) does not apply under --cp, whose layers run through "
                         "the context-parallel view; use --memory-policy efficient or offload there")
    memory = ActivationManager(cfg.memory_policy)
    memory.attach(model)
    if cfg.compile:
        compile_model(model)
    model.train()
    plan.shard(model)  # several processes: experts split, the rest FSDP2-sharded (k3.distributed.plan)
    optimizer = build_optimizer(model, lr=cfg.lr, weight_decay=cfg.weight_decay)
    scheduler = build_scheduler(optimizer, cfg.steps, cfg.warmup_frac, cfg.min_lr_ratio)
    balancer = ExpertBalancer(model, method=cfg.balance) if cfg.balance != "none" and mcfg.num_experts else None
    if cfg.qk_clip_tau:
        enable_max_logit_tracking(model)
    step, tokens = 0, 0
    if state is not None:
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        if balancer is not None:
            balancer.load_state_dict(state["balancer"])
        train_set.load_state_dict(state["data"])
        set_rng_state(state["rng"])
        step, tokens = state["step"], state["tokens"]
        log(f"resumed from {resume_from} at step {step}")
    metrics = MetricsLog(run / "metrics.jsonl", truncate_after_step=step if state is not None else None) \
        if rank == 0 else None
    amp = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else nullcontext()
    n_params = sum(p.numel() for p in model.parameters())
    log(f"k3 train: {n_params / 1e6:.2f}M params on {device}; {len(train_set)} train / {len(val_set)} val sequences "
        f"of {cfg.seq_len} tokens; val unigram entropy {entropy:.3f} nats/token")
    if rank == 0:
        (run / "run_info.json").write_text(json.dumps({"params": n_params, "unigram_entropy_nats": entropy,
                                                       "train_sequences": len(train_set), "val_sequences": len(val_set),
                                                       "train_config": cfg.to_json()}, indent=2) + "\n")

    batches = train_set.batches(cfg.batch_size * plan.batch_slices)  # the global batch; the plan splits it
    progress = Progress(cfg.steps) if rank == 0 else None
    last = {}
    t_last, tok_last = time.time(), tokens
    end = min(cfg.steps, cfg.stop_after) if cfg.stop_after else cfg.steps
    while step < end:
        loss_sum, mtp_sum = 0.0, 0.0
        logging = (step + 1) % cfg.log_every == 0 or step + 1 == cfg.steps
        for i in range(cfg.grad_accum):
            with amp, memory.forward(measure=logging and i == 0) as saved:
                loss, lm, mtp, n = plan.loss(model, next(batches), cfg.mtp_weight)
            if i == 0:
                first_saved = saved
            (loss / cfg.grad_accum).backward()
            loss_sum += lm / cfg.grad_accum
            mtp_sum += (mtp if mtp is not None else 0.0) / cfg.grad_accum
            if balancer is not None:
                balancer.observe()
            tokens += n
        plan.reduce_grads(model)
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        grad_norm = grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm
        lr = optimizer.param_groups[0]["lr"]
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        # one read of the device per step, once the optimizer's kernels are queued behind the backward's (a read
        # before them would leave the device idle while the host launches them); a non-finite loss stops the run
        # before anything of this step is saved
        loss_sum, mtp_sum, grad_norm = (float(x) for x in (loss_sum, mtp_sum, grad_norm))
        if not math.isfinite(loss_sum):
            raise FloatingPointError(f"loss became {loss_sum} at step {step}; lower --lr or check the data")
        if cfg.qk_clip_tau:
            plan.sync_max_logits(model)
        clipped = qk_clip_(model, cfg.qk_clip_tau) if cfg.qk_clip_tau else 0
        load = balancer.step() if balancer is not None else None
        step += 1
        rec = {"step": step, "loss": loss_sum, "lr": lr, "tokens": tokens, "grad_norm": grad_norm}
        if logging:  # what the first micro-batch's forward left for its backward on the device (k3.train.memory)
            rec["saved_activation_bytes"] = first_saved.kept_bytes
        if mtp_sum:
            rec["mtp_loss"] = mtp_sum
        if load is not None:
            rec["load_max_over_mean"] = load["load_max_over_mean"]
            rec["load_per_layer"] = load["per_layer"]
        if clipped:
            rec["qk_clipped_heads"] = clipped
        if step % cfg.eval_every == 0 or step == cfg.steps:
            rec["val_loss"] = evaluate(model, val_set, cfg.batch_size * plan.batch_slices, cfg.eval_batches, device, amp)
        if (step % cfg.log_every == 0 or "val_loss" in rec or step == cfg.steps) and rank == 0:
            now = time.time()
            rec["tokens_per_s"] = (tokens - tok_last) / max(now - t_last, 1e-9)
            t_last, tok_last = now, tokens
            metrics.write(rec)
            progress.update(step, rec, force="val_loss" in rec)
        last = rec
        if step % cfg.save_every == 0 or step == end:
            trainer = {"scheduler": scheduler.state_dict(), "step": step, "tokens": tokens, "rng": rng_state(),
                       "balancer": balancer.state_dict() if balancer is not None else None,
                       "data": train_set.state_dict()}
            if world == 1:
                save_checkpoint(run, model, run / "tokenizer.json", {**trainer, "optimizer": optimizer.state_dict()},
                                cfg.to_json())
            else:
                save_checkpoint(run, model, run / "tokenizer.json", trainer, cfg.to_json(),
                                model_state=plan.full_state(model), optimizer_shard=optimizer.state_dict())
    if progress is not None:
        progress.close()
    return {"step": step, "last": last, "unigram_entropy": entropy, "run": str(run), "params": n_params}
