"""Run metrics: one JSON object per logged step in ``RUN/metrics.jsonl``, and a one-line progress display.

Each record is appended with one ``write`` system call on an O_APPEND descriptor, so a process killed between
steps never leaves half a line; a kill inside that call (or a full disk, a power cut) can still tear the last
line. Readers (``read_metrics``, the resume) then ignore that last line with a warning naming the file; a line
that does not parse anywhere else means the file was damaged, and is refused with its file:line.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from ..atomic import write_text_atomic


class MetricsLog:
    def __init__(self, path: Path, truncate_after_step: int | None = None):
        self.path = Path(path)
        if truncate_after_step is not None and self.path.exists():
            # on resume, drop lines written after the checkpoint so the log reads like one uninterrupted run
            keep = [json.dumps(r) for r in read_metrics(self.path) if r.get("step", 0) <= truncate_after_step]
            write_text_atomic(self.path, "".join(ln + "\n" for ln in keep))
        elif truncate_after_step is None:
            write_text_atomic(self.path, "")

    def write(self, record: dict) -> None:
        data = (json.dumps(record) + "\n").encode()
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
        try:
            os.write(fd, data)  # one call: the line is whole in the file or absent
        finally:
            os.close(fd)


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
    lines = path.read_text(encoding="utf-8", errors="replace").split("\n")
    numbered = [(i, ln) for i, ln in enumerate(lines, start=1) if ln.strip()]
    records = []
    for k, (lineno, ln) in enumerate(numbered):
        try:
            rec = json.loads(ln)
        except json.JSONDecodeError as e:
            if k == len(numbered) - 1:  # a torn last line: the run was killed while writing it
                print(f"warning: {path}:{lineno}: the last line is incomplete (a run killed while writing it?); "
                      "ignoring it", file=sys.stderr)
                break
            raise ValueError(f"{path}:{lineno}: not a JSON metrics record ({e.msg}); the file is damaged: delete "
                             "or fix that line (each line is one step's JSON object)") from None
        if not isinstance(rec, dict):
            raise ValueError(f"{path}:{lineno}: a JSON {type(rec).__name__}, not a metrics record (an object); "
                             "delete or fix that line")
        records.append(rec)
    return records


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
