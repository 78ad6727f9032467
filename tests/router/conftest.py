"""Three `k3 serve --preset tiny --random-init` replicas and a `k3 router` in front of them, started once per module.

Small hash blocks (16 tokens) and pages (64) so that prompts of a few dozen tokens are cached; one thread per engine
(the test machine's cores are shared)."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

REPLICA_FLAGS = ("--hash-block", "16", "--page-tokens", "64", "--checkpoint-every", "4", "--prefill-chunk", "256",
                 "--step-tokens", "512", "--long-prompt", "1024", "--device", "cpu")
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(url: str, timeout: float = 5):
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.loads(r.read())


def post(url: str, body: dict, headers: dict | None = None, timeout: float = 120):
    """(status, headers, raw body bytes) of one POST."""
    req = urllib.request.Request(url, json.dumps(body).encode(), {"content-type": "application/json",
                                                                  **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()


def wait_ready(url: str, proc: subprocess.Popen, what: str, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            if get(url + "/health").get("status") == "ok":
                return
        except OSError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            stop(proc)
            raise RuntimeError(f"{what} did not start: " + proc.stderr.read().decode()[-2000:])
        time.sleep(0.3)


def start_replica(port: int) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "k3", "serve", "--preset", "tiny", "--random-init", "--port",
                             str(port), *REPLICA_FLAGS], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=ENV,
                            start_new_session=True)


def start_router(urls: list[str], *flags: str) -> tuple[str, subprocess.Popen]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "k3", "router", "--replicas", ",".join(urls), "--port", str(port),
                             "--health-every", "0.2", "--poll-every", "0.1", *flags], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, env=ENV, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    wait_ready(url, proc, "k3 router", timeout=60)
    deadline = time.monotonic() + 30
    while get(url + "/health")["healthy_replicas"] < len(urls) and time.monotonic() < deadline:
        time.sleep(0.1)
    return url, proc


def stop(proc: subprocess.Popen, sig=signal.SIGTERM) -> None:
    """The process group we started (the replica's engine process with it)."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            pass
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)


class Fleet:
    def __init__(self, n: int = 3):
        self.ports = [free_port() for _ in range(n)]
        self.urls = [f"http://127.0.0.1:{p}" for p in self.ports]
        self.procs = [start_replica(p) for p in self.ports]
        for u, p in zip(self.urls, self.procs):
            wait_ready(u, p, f"k3 serve at {u}")

    def kill(self, url: str) -> None:
        stop(self.procs[self.urls.index(url)], signal.SIGKILL)

    def restart(self, url: str) -> None:
        i = self.urls.index(url)
        self.procs[i] = start_replica(self.ports[i])
        wait_ready(url, self.procs[i], f"k3 serve at {url}")

    def close(self) -> None:
        for p in self.procs:
            stop(p)


@pytest.fixture(scope="module")
def fleet():
    f = Fleet(3)
    yield f
    f.close()
