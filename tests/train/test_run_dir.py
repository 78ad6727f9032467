"""The run directory's safety: one trainer per --out (train.lock), a torn metrics line, the checkpoint cadence,
no empty --out left by a failed run."""

import json
import os
import socket
import subprocess
import sys

import pytest

from k3.cli import main
from k3.train.lock import RunLock, RunLocked
from k3.train.loop import TrainConfig
from k3.train.metrics import read_metrics
from k3.train.state import find_checkpoint, read_step
from k3.train.trainer import Trainer

from .test_loop import losses, run


def test_a_second_trainer_on_one_out_is_refused_naming_the_holder(tmp_path):
    out = tmp_path / "r"
    run(tmp_path, "r", stop_after=2)
    before = (out / "metrics.jsonl").read_text()
    with RunLock(out):  # a live holder: this process, through another descriptor
        with pytest.raises(RunLocked) as e:
            run(tmp_path, "r")
    msg = str(e.value)
    assert f"pid {os.getpid()} on host {socket.gethostname()}" in msg and str(out / "train.lock") in msg
    assert "another --out" in msg
    assert (out / "metrics.jsonl").read_text() == before and read_step(find_checkpoint(out)) == 2  # untouched
    run(tmp_path, "r")  # the holder gone, the run resumes
    assert [r["step"] for r in read_metrics(out)] == list(range(1, 7))


def test_a_lock_left_by_a_dead_process_is_taken_over_with_a_message(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    pid = int(dead.stdout)
    (tmp_path / "r").mkdir()
    (tmp_path / "r" / "train.lock").write_text(json.dumps({"pid": pid, "host": socket.gethostname(),
                                                             "command": "k3 train --out r", "started": "then"}))
    said = []
    lock = RunLock(tmp_path / "r", said.append)
    lock.acquire()
    try:
        assert len(said) == 1 and f"no longer running (pid {pid} on host" in said[0]
        assert json.loads((tmp_path / "r" / "train.lock").read_text())["pid"] == os.getpid()
    finally:
        lock.release()
    assert (tmp_path / "r" / "train.lock").read_text() == ""  # emptied, not deleted, when the run ends


def test_the_cli_refuses_a_second_k3_train_in_one_line(tmp_path, capsys):
    out = tmp_path / "r"
    out.mkdir()
    with RunLock(out):
        assert main(["train", "--out", str(out), "--steps", "1"]) == 1
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "is in use by another training run (pid" in err


def test_a_torn_last_metrics_line_is_ignored_loudly_and_the_run_resumes(tmp_path, capsys):
    out = tmp_path / "r"
    run(tmp_path, "r", stop_after=3)
    with open(out / "metrics.jsonl", "a") as f:
        f.write('{"step": 4, "loss": 5.1')  # killed while writing step 4's line
    assert [r["step"] for r in read_metrics(out)] == [1, 2, 3]
    err = capsys.readouterr().err
    assert f"{out / 'metrics.jsonl'}:4: the last line is incomplete" in err
    assert main(["plot", str(out)]) == 0 and (out / "loss.png").exists()
    run(tmp_path, "r")  # resume: the torn line is dropped, the log reads like one run
    run(tmp_path, "straight")
    assert losses(out) == losses(tmp_path / "straight")
    assert all(json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines())


def test_a_damaged_metrics_line_inside_the_file_is_named(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "loss": 1.0}\n{"step": 2, "lo\n{"step": 3, "loss": 1.0}\n')
    with pytest.raises(ValueError, match=f"{path}:2: not a JSON metrics record .* delete or fix that line"):
        read_metrics(path)


def test_the_default_checkpoint_cadence_is_a_tenth_of_the_run_or_minutes():
    assert TrainConfig(out="x", steps=200).save_interval == 20  # the probe's --steps 200 under the old 500
    assert TrainConfig(out="x", steps=3).save_interval == 1
    assert TrainConfig(out="x", steps=200, save_every=500).save_interval == 500  # an explicit value is kept
    cfg = TrainConfig(out="x", steps=10_000, save_every=5000, save_minutes=30)
    assert not cfg.save_due(7, 10_000, 29.9) and cfg.save_due(7, 10_000, 30.0)  # the clock, whichever first
    assert not TrainConfig(out="x", steps=100, save_minutes=0).save_due(7, 100, 1e9)
    with pytest.raises(ValueError, match="save_minutes"):
        TrainConfig(out="x", save_minutes=-1)


def test_a_run_checkpoints_by_default_and_on_the_clock(tmp_path, monkeypatch):
    saved = []
    save = Trainer.save

    def record(self, *a, **kw):
        saved.append(self.step_count)
        return save(self, *a, **kw)

    monkeypatch.setattr(Trainer, "save", record)
    run(tmp_path, "a", steps=10, save_every=None)
    assert saved == [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]  # a tenth of 10 steps
    saved.clear()
    run(tmp_path, "b", steps=4, save_every=1000, save_minutes=1e-9)  # every step is past the time budget
    assert saved == [1, 2, 3, 4]


def test_a_failed_run_leaves_no_empty_out_directory(tmp_path, capsys):
    out = tmp_path / "new"
    tiny = tmp_path / "tiny.txt"
    tiny.write_text("a few words\n\nand a few more\n")
    assert main(["train", "--out", str(out), "--data", str(tiny), "--steps", "1", "--vocab-size", "300"]) == 1
    assert "is one document" in capsys.readouterr().err and not out.exists()
    kept = tmp_path / "kept"
    kept.mkdir()
    (kept / "notes.txt").write_text("mine")
    assert main(["train", "--out", str(kept), "--data", str(tiny), "--steps", "1", "--vocab-size", "300"]) == 1
    assert (kept / "notes.txt").read_text() == "mine"  # a directory that was there before stays
