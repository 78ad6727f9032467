"""Run metrics: one JSON object per logged step in ``RUN/metrics.jsonl``, and a one-line progress display."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path


class MetricsLog:
    def __init__(self, path: Path, truncate_after_step: int | None = None):
        self.path = Path(path)
        if truncate_after_step is not None and self.path.exists():
            # on resume, drop lines written after the checkpoint so the log reads like one uninterrupted run
            keep = [ln for ln in self.path.read_text().splitlines() if ln.strip()
                    and json.loads(ln).get("step", 0) <= truncate_after_step]
            self.path.write_text("".join(ln + "\n" for ln in keep))
        elif truncate_after_step is None:
            self.path.write_text("")

    def write(self, record: dict) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")


def moe_layer_labels(model) -> list[str]:
    """Names of the model's MoE layers in the balancer's order (``load_per_layer``), numbered from 1 as the README
    numbers layers: "layer 2", ..., "MTP 1"."""
    from ..layers.width.latent_moe import LatentMoE  # train sits above layers

    labels = []
    for name, m in model.named_modules():
        if isinstance(m, LatentMoE):
            parts = name.split(".")
            labels.append(f"layer {int(parts[2]) + 1}" if parts[:2] == ["model", "layers"] else
                          f"MTP {int(parts[1]) + 1}" if parts[0] == "mtp" else name)
    return labels


def read_metrics(path: Path) -> list[dict]:
    path = Path(path)
    if path.is_dir():
        path = path / "metrics.jsonl"
    if not path.exists():
        raise FileNotFoundError(f"no metrics.jsonl at {path}: is this a k3 train/demo output directory?")
    return [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()]


class Progress:
    """``step 120/300 [####------] loss 3.412 | val 3.60 | 18.2k tok/s | lr 2.9e-03 | load 1.08``."""

    def __init__(self, total: int, stream=sys.stderr, width: int = 20):
        self.total, self.stream, self.width = total, stream, width
        self.tty = hasattr(stream, "isatty") and stream.isatty()
        self.last_print = 0.0

    def update(self, step: int, rec: dict, force: bool = False) -> None:
        now = time.time()
        if not force and self.tty and now - self.last_print < 0.2:
            return
        self.last_print = now
        done = int(self.width * step / max(self.total, 1))
        parts = [f"step {step}/{self.total} [{'#' * done}{'-' * (self.width - done)}]", f"loss {rec['loss']:.3f}"]
        if "val_loss" in rec:
            parts.append(f"val {rec['val_loss']:.3f}")
        parts += [f"{rec.get('tokens_per_s', 0) / 1e3:.1f}k tok/s", f"lr {rec['lr']:.2e}"]
        if "load_max_over_mean" in rec:
            parts.append(f"load {rec['load_max_over_mean']:.2f}")
        line = " | ".join(parts)
        if self.tty and not force:
            self.stream.write("\r" + line + "\x1b[K")
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()
