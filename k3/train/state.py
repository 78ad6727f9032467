"""Training checkpoints: the model in the official HF layout plus everything needed to resume bit-exactly.

A checkpoint is a directory ``RUN/checkpoint``:

    config.json, model.safetensors (or shards + index)   the model, loadable by k3.pretrained.load_pretrained
    tokenizer.json                                        the run's tokenizer
    trainer_state.pt                                      optimiser, scheduler, balancer, data position, RNG, step
    train_config.json                                     the TrainConfig the run was started with
    SHA256SUMS                                            a checksum of every file (k3.checkpoint.manifest)

It is written into a temporary sibling directory and renamed into place, so a crash mid-write leaves the
previous checkpoint intact (``checkpoint.old`` is only there during the swap and is used if found alone).
Under data parallelism (FSDP2) the model is gathered to full tensors and written once, and each rank adds
``optimizer.rank{r}.pt``; such a checkpoint resumes with the same number of ranks.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
import torch.distributed as dist

from ..checkpoint import CheckpointError
from ..pretrained import load_pretrained, save_pretrained
from ..checkpoint.manifest import record_checksums, verify_checksums
from ..config import K3Config

NAME, OLD = "checkpoint", "checkpoint.old"
TRAINER_FILES = ("tokenizer.json", "trainer_state.pt", "train_config.json")
# settings a run cannot change on resume: the data cursor, the optimiser state or the model depend on them
# (--steps may change: see k3.train.schedule)
FIXED_ON_RESUME = ("preset", "config", "data", "data_max_bytes", "doc_chars", "val_fraction", "vocab_size", "seq_len",
                   "batch_size", "grad_accum", "lr", "weight_decay", "warmup_frac", "min_lr_ratio", "balance", "seed",
                   "vision", "packing")
OLDER_DEFAULTS = {"packing": "documents"}  # what a run saved before the setting existed ran with


def rng_state() -> dict:
    state = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(run_dir: Path, model, tokenizer_path: Path, trainer_state: dict, train_config: dict,
                    model_state: dict | None = None, optimizer_shard: dict | None = None) -> Path:
    """Write RUN/checkpoint atomically. Under data parallelism every rank calls this (collectively):
    ``model_state`` is the gathered full state (written by rank 0) and each rank writes its own
    ``optimizer.rank{r}.pt`` (the optimiser state of its FSDP shards)."""
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    run_dir = Path(run_dir)
    tmp = run_dir / f".checkpoint.tmp-{trainer_state['step']}"
    try:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir()
        _barrier(world)
        if optimizer_shard is not None:
            torch.save(optimizer_shard, tmp / f"optimizer.rank{rank}.pt")
        if rank == 0:
            save_pretrained(model, tmp, state=model_state)
            shutil.copyfile(tokenizer_path, tmp / "tokenizer.json")
            torch.save({**trainer_state, "world_size": world}, tmp / "trainer_state.pt")
            (tmp / "train_config.json").write_text(json.dumps(train_config, indent=2) + "\n")
        _barrier(world)
        final, old = run_dir / NAME, run_dir / OLD
        if rank == 0:
            shards = [f"optimizer.rank{r}.pt" for r in range(world)] if optimizer_shard is not None else []
            record_checksums(tmp, [*TRAINER_FILES, *shards])  # the weights' sums are in already (save_pretrained)
            if final.exists():
                shutil.rmtree(old, ignore_errors=True)
                os.replace(final, old)
            os.replace(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        _barrier(world)
        return final
    except BaseException:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise


def _barrier(world: int) -> None:
    if world > 1:
        dist.barrier()


def find_checkpoint(run_dir: Path) -> Path | None:
    run_dir = Path(run_dir)
    for name in (NAME, OLD):
        if (run_dir / name / "trainer_state.pt").exists():
            return run_dir / name
    return None


def read_step(ckpt: Path) -> int:
    """The step a checkpoint was saved at, without reading its tensors (memory-mapped)."""
    try:
        return int(torch.load(Path(ckpt) / "trainer_state.pt", map_location="cpu", weights_only=False,
                              mmap=True)["step"])
    except Exception as e:  # noqa: BLE001 - any failure means the file is damaged
        raise CheckpointError(f"{Path(ckpt) / 'trainer_state.pt'} could not be read (truncated or corrupt?): {e}") \
            from None


def check_resumable(ckpt: Path, train_config: dict, verify: bool = True) -> tuple[int, int]:
    """Before resuming from ``ckpt``: verify its files (unless ``verify`` is False), refuse a run whose fixed
    settings differ (naming each, with both values). Returns (the step it was saved at, its run's --steps)."""
    ckpt = Path(ckpt)
    if verify:
        verify_checksums(ckpt)
    try:
        saved = json.loads((ckpt / "train_config.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{ckpt / 'train_config.json'} could not be read ({e}); the checkpoint is "
                              "incomplete or corrupt") from None
    saved = {**OLDER_DEFAULTS, **saved}
    changed = [f"--{k.replace('_', '-')} {saved.get(k)} (now {train_config[k]})" for k in FIXED_ON_RESUME
               if saved.get(k) != train_config[k]]
    if changed:
        raise ValueError(f"{ckpt} was written by a run with different settings: {', '.join(changed)}; resume with "
                         "the same values (only --steps and the logging/saving options may change) or use a new "
                         "--out directory")
    return read_step(ckpt), saved["steps"]


def load_checkpoint(ckpt: Path, expected: K3Config | None, device="cpu", verify: bool = True, vision: bool = False):
    """-> (model, trainer_state). Raises CheckpointError naming what does not match or cannot be read.
    ``verify``: check every file against the checkpoint's SHA256SUMS first. ``vision``: the multimodal model
    (``load_pretrained``'s)."""
    ckpt = Path(ckpt)
    if verify:
        verify_checksums(ckpt)
    saved = K3Config.from_hf(ckpt)
    if expected is not None and saved != expected:
        diff = [f for f in expected.__dataclass_fields__ if getattr(saved, f) != getattr(expected, f)]
        raise CheckpointError(f"{ckpt} was written for another model config (fields differ: {diff}); "
                              f"resume with the same --preset/--config or start a new --out directory")
    model = load_pretrained(ckpt, config=saved, device=device, dtype=torch.float32, verify=False,  # verified above
                            vision=vision)
    state = _load(ckpt / "trainer_state.pt")
    world = dist.get_world_size() if dist.is_initialized() else 1
    if isinstance(state.get("optimizer"), dict) and state["optimizer"].get("format") == "by_name":
        return model, state  # optimiser state by parameter name (k3.train.optim.named): any layout resumes it
    if state.get("world_size", 1) != world:
        raise CheckpointError(f"{ckpt} was written by {state.get('world_size', 1)} data-parallel ranks; resume it "
                              f"with the same number of processes (got {world})")
    if world > 1:
        state["optimizer"] = _load(ckpt / f"optimizer.rank{dist.get_rank()}.pt")
    return model, state


def _load(path: Path):
    try:
        return torch.load(path, map_location="cpu", weights_only=False)
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing: the checkpoint is incomplete") from None
    except Exception as e:  # noqa: BLE001 - any unpickling failure means the file is damaged
        raise CheckpointError(f"{path} could not be read (truncated or corrupt?): {e}") from None
