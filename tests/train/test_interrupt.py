"""Ctrl-C during training: a checkpoint at the step boundary, a message saying where it is, an exact resume."""

import os
import signal
import subprocess
import sys
import threading

import pytest

from k3.train.interrupt import TrainingInterrupted
from k3.train.metrics import MetricsLog, read_metrics
from k3.train.state import find_checkpoint, read_step

from .test_loop import losses, run


@pytest.mark.slow
def test_ctrl_c_saves_at_the_step_boundary_and_the_run_resumes_exactly(tmp_path, monkeypatch):
    write = MetricsLog.write

    def ctrl_c_at_step_4(self, rec):
        write(self, rec)
        if rec["step"] == 4:
            os.kill(os.getpid(), signal.SIGINT)  # as a terminal's Ctrl-C: the handler runs in this thread

    monkeypatch.setattr(MetricsLog, "write", ctrl_c_at_step_4)
    with pytest.raises(TrainingInterrupted) as e:
        run(tmp_path, "cut")
    assert e.value.step == 4 and e.value.checkpoint == tmp_path / "cut" / "checkpoint"
    assert read_step(find_checkpoint(tmp_path / "cut")) == 4 and signal.getsignal(signal.SIGINT) is \
        signal.default_int_handler  # the handler is removed again
    monkeypatch.undo()
    run(tmp_path, "cut")  # the same command again
    run(tmp_path, "straight")
    assert losses(tmp_path / "cut") == losses(tmp_path / "straight")


@pytest.mark.slow
def test_k3_train_ctrl_c_says_where_the_checkpoint_is(tmp_path):
    out = tmp_path / "run"
    argv = [sys.executable, "-m", "k3", "train", "--preset", "tiny", "--out", str(out), "--steps", "500",
            "--batch-size", "2", "--seq-len", "32", "--vocab-size", "300", "--data-max-bytes", "100000",
            "--log-every", "1", "--eval-every", "1000", "--save-every", "1000"]
    p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines = []
    for line in p.stderr:  # progress lines, one per step when stderr is not a terminal
        lines.append(line)
        if line.startswith("step 2/500"):
            p.send_signal(signal.SIGINT)
            break
    timer = threading.Timer(300, p.kill)
    timer.start()
    err = "".join(lines) + p.stderr.read()
    timer.cancel()
    assert p.wait() == 130, err
    assert "Traceback" not in err and "stopping after this step with a checkpoint" in err
    step = read_step(out / "checkpoint")
    assert step >= 2 and read_metrics(out)[-1]["step"] == step
    assert f"interrupted; the checkpoint of step {step} is in {out / 'checkpoint'}: run the same command" in err


def test_the_first_ctrl_c_asks_the_second_interrupts_and_before_the_steps_it_interrupts(capsys):
    from k3.train.interrupt import StopRequest

    with StopRequest(), pytest.raises(KeyboardInterrupt):  # not armed: reading data, building the model
        os.kill(os.getpid(), signal.SIGINT)
    with StopRequest() as stop:
        stop.arm()
        os.kill(os.getpid(), signal.SIGINT)
        assert stop.requested and "stopping after this step" in capsys.readouterr().err
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
