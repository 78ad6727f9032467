"""The training loop: data -> K3ForCausalLM -> Muon/AdamW, Quantile Balancing, QK-clip, checkpoints (SPEC §4-§5).

``train(TrainConfig(...))`` is what ``k3 train``, ``k3 demo`` and ``k3 sft`` (chat data: k3.post.sft_data) run.
One optimiser step = ``grad_accum`` micro-batches of ``batch_size`` packed sequences of ``seq_len`` tokens
(documents delimited by cu_seqlens), taken by a ``Trainer`` (k3.train.trainer).
"""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ..config import K3Config
from ..data import PackedDataset
from ..data.packing import count_targets, media_inputs
from . import data as run_data
from .interrupt import StopRequest, TrainingInterrupted
from .lock import RunLock
from .metrics import MetricsLog, Progress, moe_layer_labels, read_metrics
from .plan import TrainingPlan
from .state import check_resumable, find_checkpoint
from .trainer import Trainer, build_model

MIN_SEQ_LEN = 4  # shorter samples can hold no next-token or MTP target at all (the loss would be 0/0)
# the smallest value of each integer setting (None, where allowed, means "all" / "never")
MINIMUMS = {"steps": 1, "batch_size": 1, "seq_len": MIN_SEQ_LEN, "grad_accum": 1, "eval_every": 1, "eval_batches": 1,
            "log_every": 1, "save_every": 1, "data_max_bytes": 1, "doc_chars": 1, "tokenizer_bytes": 1,
            "stop_after": 1, "dp": 1, "cp": 1, "ep": 1, "pp": 1}
# the default checkpoint cadence: every SAVE_FRACTION of --steps (when --save-every is not given), and in any case
# once SAVE_MINUTES have passed since the last checkpoint, whichever comes first: a killed run loses at most that
SAVE_FRACTION = 0.1
SAVE_MINUTES = 30.0
DOC_CHARS_PER_TOKEN = 8  # default --doc-chars: 8 x seq_len characters (about two samples of text), at least 8192


@dataclass(frozen=True)
class TrainConfig:
    out: str
    preset: str | None = "tiny"
    config: str | None = None  # an HF config.json; overrides preset
    data: str | None = None  # text file, directory or JSONL; None = the embedded standard-library corpus
    data_max_bytes: int | None = None  # cap on corpus bytes read (None = all)
    packing: str = "documents"  # documents: each its own segment; stream: one segment per sample (k3.data.packing)
    doc_chars: int | None = None  # user text is cut at blank lines into documents of at most this many characters
    # (None = max(8192, 8 x seq_len)); the embedded corpus is one document per file
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
    save_every: int | None = None  # a checkpoint every N steps (None: every SAVE_FRACTION of the steps)
    save_minutes: float = SAVE_MINUTES  # ... and once this many minutes have passed since the last (0 = never)
    seed: int = 0
    device: str = "auto"
    kda_backend: str = "auto"
    memory_policy: str = "keep"  # keep | efficient | offload | recompute (k3.train.memory)
    compile: bool = False  # regional torch.compile (k3.train.compile)
    cuda_graph: bool = False  # each micro-batch's forward + backward replayed as one CUDA graph (k3.train.graph)
    val_fraction: float = 0.05
    stop_after: int | None = None  # stop (with a checkpoint) after this step; rerun the same command to resume
    dp: int = 1  # data-parallel ranks (FSDP2) when run under torchrun; batch_size is per rank
    cp: int = 1  # context-parallel ranks: every sequence is split along time over them (KCP + gathered MLA)
    ep: int = 1  # expert-parallel ranks: routed experts sharded, MoonEP-balanced all-to-all dispatch
    pp: int = 1  # pipeline ranks (k3.distributed.pipeline_plan): decoder layers cut into stages
    pp_schedule: str = "1f1b"  # 1f1b | interleaved | zero-bubble
    pp_virtual: int | None = None  # stages per pipeline rank (None: 1 for 1f1b, 2 otherwise)
    pp_layers: tuple | None = None  # decoder layers per stage (None: balanced by the cost model)
    verify: bool = True  # check the checkpoint's SHA256SUMS before resuming from it
    qat: str | None = None  # "mxfp4": quantisation-aware training of the routed experts (SPEC §6)
    init_from: str | None = None  # start from this checkpoint's weights and tokenizer (fine-tuning, e.g. QAT)
    chat: bool = False  # k3 sft: --data is JSONL of chat messages; the loss is on the assistant's tokens only
    vision: str | None = None  # k3 sft: a new vision tower of this k3.vision preset for a model without one

    def __post_init__(self):
        def need(ok: bool, name: str, what: str) -> None:
            if not ok:
                raise ValueError(f"TrainConfig.{name} {what}; got {getattr(self, name)!r}")

        for name, lo in MINIMUMS.items():
            v = getattr(self, name)
            need(v is None or v >= lo, name, f"must be >= {lo}")
        finite = lambda name: math.isfinite(getattr(self, name))  # noqa: E731
        need(finite("lr") and self.lr > 0, "lr", "must be a positive number")
        for name in ("weight_decay", "mtp_weight", "grad_clip", "save_minutes"):
            need(finite(name) and getattr(self, name) >= 0, name, "must be a number >= 0")
        need(0 <= self.min_lr_ratio <= 1, "min_lr_ratio", "must be in [0, 1]")
        need(0 <= self.warmup_frac < 1, "warmup_frac", "must be in [0, 1)")
        need(0 < self.val_fraction < 1, "val_fraction", "must be in (0, 1): training reports a validation loss")
        need(self.qk_clip_tau is None or self.qk_clip_tau > 0, "qk_clip_tau", "must be > 0 (None disables QK-clip)")
        need(self.balance in ("quantile", "sign", "none"), "balance", "must be quantile, sign or none")
        need(self.packing in ("documents", "stream"), "packing", "must be documents or stream")
        need(not (self.chat and self.packing == "stream"), "packing",
             "must be documents for chat data (a stream would let one conversation attend to another)")

    @property
    def save_interval(self) -> int:
        """Steps between checkpoints: ``save_every``, or by default a tenth of the run (at least 1)."""
        return self.save_every or max(1, math.ceil(self.steps * SAVE_FRACTION))

    def save_due(self, step: int, end: int, minutes_since_save: float) -> bool:
        """Whether to checkpoint after ``step``: on the step interval, at the run's last step, or when
        ``save_minutes`` have passed since the last checkpoint (the first of these)."""
        return (step % self.save_interval == 0 or step == end
                or (self.save_minutes > 0 and minutes_since_save >= self.save_minutes))

    @property
    def max_doc_chars(self) -> int:
        return self.doc_chars or max(8192, DOC_CHARS_PER_TOKEN * self.seq_len)

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


def _quiet(*args, **kwargs) -> None:
    pass


def resolve_device(name: str) -> torch.device:
    """``auto`` (CUDA when available, else CPU), ``cpu``, ``cuda``, ``cuda:N``, ...; a device this machine does not
    have is refused here with what to use instead, not deep inside PyTorch."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ValueError(f"--device {name!r} is not a device name; use auto, cpu, cuda or cuda:N") from None
    if device.type == "cuda":
        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if n == 0:
            raise ValueError(f"--device {name}: no CUDA device is available (torch {torch.__version__}"
                             f"{' is a CPU-only build' if torch.version.cuda is None else ' sees no GPU'}); "
                             "use --device cpu (or auto)")
        if device.index is not None and device.index >= n:
            raise ValueError(f"--device {name}: this machine has {n} CUDA device(s), cuda:0 to cuda:{n - 1}")
    return device


def _model_config(cfg: TrainConfig, tokenizer) -> K3Config:
    """The preset's (or --config's / --init-from's) configuration with the tokenizer's vocabulary and, when the
    configuration names none, its end-of-sequence id: saved checkpoints then tell transformers' ``generate`` and
    mlx-lm where to stop (config.json and generation_config.json)."""
    from ..data.tokenizer import eos_id

    src = run_data.init_dir(cfg) or cfg.config
    base = K3Config.from_hf(src) if src else K3Config.preset(cfg.preset)
    eos = base.eos_token_id if base.eos_token_id is not None else eos_id(tokenizer)
    return base.replace(vocab_size=tokenizer.get_vocab_size(), qat=cfg.qat, eos_token_id=eos)


@torch.no_grad()
def evaluate(model, dataset: PackedDataset, batch_size: int, max_batches: int, device, amp) -> float:
    """Mean next-token loss over the first ``max_batches`` validation batches (token-weighted; only the targets
    of batches with "labels")."""
    was = model.training
    model.eval()
    total, n = 0.0, 0
    for i, b in enumerate(dataset.eval_batches(batch_size)):
        if i >= max_batches:
            break
        count = count_targets(b["cu_seqlens"], b.get("labels"), 1)  # positions predicting their own document
        if count == 0:  # a last, short batch of one-token segments: nothing to score
            continue
        ids, cu = b["input_ids"].to(device), b["cu_seqlens"].to(device)
        labels = b["labels"].to(device) if "labels" in b else ids
        with amp:
            loss = model(ids, cu_seqlens=cu, labels=labels, mtp_weight=0.0, return_logits=False,
                         **media_inputs(b, device))["lm_loss"]
        total, n = total + loss.item() * count, n + count
    model.train(was)
    return total / max(n, 1)


def train(cfg: TrainConfig, plan: TrainingPlan, log=print, prepare=None) -> dict:
    """Run (or resume) training under ``plan``, the run's layout over processes (k3.train.plan's contract; the
    caller builds it: ``k3.distributed.plan.ParallelPlan(ParallelDims(dp, ep, cp), device)``, every size 1 for one
    process, as ``k3.cli.train.run_training`` does). In one process, Ctrl-C stops after the current step with a
    checkpoint and raises TrainingInterrupted. ``prepare(cfg, run, resume_from, plan) -> RunData``: the run's data
    (default ``k3.train.data.prepare``, text; ``k3.post.sft_data.prepare`` for chat)."""
    with StopRequest(enabled=plan.world == 1) as stop:
        return _train(cfg, plan, log, stop, prepare or run_data.prepare)


def _already_complete(run: Path, ckpt: Path, done: int, cfg: TrainConfig, log) -> dict:
    log(f"{run} is already complete: its checkpoint {ckpt} is at step {done} (--steps {cfg.steps}); rerun with a "
        "larger --steps to train further")
    recs = read_metrics(run) if (run / "metrics.jsonl").exists() else []
    info = json.loads((run / "run_info.json").read_text()) if (run / "run_info.json").exists() else {}
    return {"step": done, "last": recs[-1] if recs else {}, "unigram_entropy": info.get("unigram_entropy_nats"),
            "run": str(run), "params": info.get("params"), "already_complete": True}


def _agreed_minutes(plan: TrainingPlan, since: float) -> float:
    """Minutes since ``since`` (a monotonic time), the same on every rank (their mean): a save is collective, so
    all ranks must decide it alike."""
    minutes = (time.monotonic() - since) / 60
    if plan.world == 1:
        return minutes
    return float(plan.mean(torch.tensor(minutes, device=plan.device)).item())


def _train(cfg: TrainConfig, plan: TrainingPlan, log, stop: StopRequest, prepare) -> dict:
    run = Path(cfg.out)
    rank, world = plan.rank, plan.world
    if world != cfg.dp * cfg.cp * cfg.ep * cfg.pp:
        raise ValueError(f"--pp {cfg.pp} x --dp {cfg.dp} x --cp {cfg.cp} x --ep {cfg.ep} ranks but {world} process(es) "
                         "are running: start them under `torchrun --nproc_per_node N -m k3 train ...` with "
                         "N = pp x dp x cp x ep")
    created = False
    if rank == 0:
        try:
            run.mkdir(parents=True)
            created = True
        except FileExistsError:
            if not run.is_dir():
                raise NotADirectoryError(f"--out {run}: exists and is not a directory; give a directory") from None
    plan.barrier()
    lock = RunLock(run, log) if rank == 0 else None
    if lock is not None:
        try:
            lock.acquire()
        except BaseException:
            _remove_if_unused(run, created)
            raise
    try:
        return _train_locked(cfg, plan, log, stop, prepare, run)
    except BaseException:
        if lock is not None:
            lock.release()
            lock = None
            _remove_if_unused(run, created)
        raise
    finally:
        if lock is not None:
            lock.release()


def _remove_if_unused(run: Path, created: bool) -> None:
    """A run directory this process made, whose run failed before its first checkpoint and first metrics line,
    holds nothing of value (a tokenizer, run_info.json, an empty log): removed, so a failed command leaves no empty
    --out behind. A directory that existed before, or holds a checkpoint or logged steps, is kept."""
    if not created or find_checkpoint(run) is not None:
        return
    metrics = run / "metrics.jsonl"
    if metrics.exists() and metrics.stat().st_size > 0:
        return
    shutil.rmtree(run, ignore_errors=True)


def _train_locked(cfg: TrainConfig, plan: TrainingPlan, log, stop: StopRequest, prepare, run: Path) -> dict:
    rank = plan.rank
    device = plan.device
    if rank != 0:
        log = _quiet
    resume_from = find_checkpoint(run)
    saved_steps = None
    if resume_from is not None:
        done, saved_steps = check_resumable(resume_from, cfg.to_json(), cfg.verify)
        if done >= cfg.steps:
            return _already_complete(run, resume_from, done, cfg, log)

    data = prepare(cfg, run, resume_from, plan)
    train_set, val_set, entropy = data.train, data.val, data.unigram_entropy
    mcfg = _model_config(cfg, data.tokenizer)

    torch.manual_seed(cfg.seed)
    model, state = (data.build_model or build_model)(mcfg, device, resume_from,
                                                      None if resume_from else run_data.init_dir(cfg))
    trainer = Trainer(cfg, plan, model, state, saved_steps, log)
    if state is not None:
        train_set.load_state_dict(state["data"])
        log(f"resumed from {resume_from} at step {trainer.step_count}")
    step = trainer.step_count
    metrics = MetricsLog(run / "metrics.jsonl", truncate_after_step=step if state is not None else None) \
        if rank == 0 else None
    n_params = sum(p.numel() for p in model.parameters())
    log(f"k3 {'sft' if cfg.chat else 'train'}: {n_params / 1e6:.2f}M params on {device}; {len(train_set)} train / {len(val_set)} val "
        f"sequences of {cfg.seq_len} tokens; val unigram entropy {entropy:.3f} nats/token")
    if rank == 0:
        (run / "run_info.json").write_text(json.dumps({"params": n_params, "unigram_entropy_nats": entropy,
                                                       "train_sequences": len(train_set), "val_sequences": len(val_set),
                                                       "load_layers": moe_layer_labels(model),
                                                       "train_config": cfg.to_json()}, indent=2) + "\n")

    batches = train_set.batches(cfg.batch_size * plan.batch_slices)  # the global batch; the plan splits it
    progress = Progress(cfg.steps) if rank == 0 else None
    last = {}
    t_last, tok_last = time.time(), trainer.tokens
    end = min(cfg.steps, cfg.stop_after) if cfg.stop_after else cfg.steps
    stopping = False
    last_save = time.monotonic()
    stop.arm()
    while step < end:
        logging = (step + 1) % cfg.log_every == 0 or step + 1 == cfg.steps
        rec = trainer.step([next(batches) for _ in range(cfg.grad_accum)], measure=logging)
        step = rec["step"]
        if step % cfg.eval_every == 0 or step == cfg.steps:
            rec["val_loss"] = getattr(plan, "evaluate", evaluate)(model, val_set, cfg.batch_size * plan.batch_slices, cfg.eval_batches, device,
                                       trainer.amp)
        if (step % cfg.log_every == 0 or "val_loss" in rec or step == cfg.steps) and rank == 0:
            now = time.time()
            rec["tokens_per_s"] = (trainer.tokens - tok_last) / max(now - t_last, 1e-9)
            t_last, tok_last = now, trainer.tokens
            metrics.write(rec)
            progress.update(step, rec, force="val_loss" in rec)
        last = rec
        stopping = stop.requested and step < end  # read once: the checkpoint is of the step the run stops at
        if cfg.save_due(step, end, _agreed_minutes(plan, last_save)) or stopping:
            trainer.save(run, run / "tokenizer.json", {"data": train_set.state_dict()}, cfg.to_json())
            last_save = time.monotonic()
        if stopping:
            break
    if progress is not None:
        progress.close()
    if stopping:
        raise TrainingInterrupted(step, run / "checkpoint")
    return {"step": step, "last": last, "unigram_entropy": entropy, "run": str(run), "params": n_params}
