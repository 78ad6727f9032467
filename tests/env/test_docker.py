"""The docker backend behind the same interface; skipped with the daemon's answer where none runs."""

from __future__ import annotations

import time

import pytest

from k3.env.docker import DockerSandbox, available

OK, WHY = available()
pytestmark = [pytest.mark.slow, pytest.mark.skipif(not OK, reason=f"no docker daemon: {WHY}")]


@pytest.fixture
def box():
    b = DockerSandbox.create({"a.txt": "hello\n"})
    yield b
    b.close()


def test_exec_shell_files(box):
    assert box.exec("cat a.txt").stdout == "hello\n"
    box.write("d/b.txt", "B")
    assert box.read("d/b.txt") == b"B" and box.listdir() == ["a.txt", "d"]
    box.shell("cd d && export X=1")
    assert box.shell("echo $X; pwd").stdout == "1\n/workspace/d\n"


def test_pause_fork_snapshot(box):
    box.pause()
    box.resume()
    f = box.fork()
    try:
        f.write("a.txt", "child")
        assert box.read("a.txt") == b"hello\n"
        box.write("p.txt", "p")
        assert "p.txt" not in f.listdir()
    finally:
        f.close()
    s = box.snapshot()
    box.write("a.txt", "changed")
    box.restore(s)
    assert box.read("a.txt") == b"hello\n"


def test_limits(box):
    assert "refused" in box.exec("python3 -c \"import socket\ntry: socket.create_connection(('1.1.1.1', 80), 2)\n"
                                 "except OSError: print('refused')\"").stdout
    t0 = time.perf_counter()
    assert box.exec("sleep 30", timeout=1).violation == "wall" and time.perf_counter() - t0 < 20
