"""Run untrusted Python in a subprocess with a wall-clock limit, a CPU-time limit and an address-space limit.

``run_python(source, timeout=2.0, memory_mb=256)`` -> ``SandboxResult(ok, returncode, timed_out, stderr)``: the
code runs in a fresh interpreter (``python -I``: no user site, no environment variables, no current directory on
the path) in an empty temporary directory, with RLIMIT_CPU and RLIMIT_AS set in the child before it starts and
the whole process group killed when the wall clock runs out. It contains mistakes (infinite loops, runaway
memory, exceptions, ``sys.exit``), not a determined attacker: there is no filesystem or network isolation.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass

__all__ = ["SandboxResult", "run_python"]


@dataclass(frozen=True)
class SandboxResult:
    ok: bool  # exited with status 0 within the limits
    returncode: int | None
    timed_out: bool
    stderr: str


def _limits(cpu_seconds: int, memory_bytes: int):
    def apply():
        import resource

        os.setsid()  # its own process group: a timeout kills whatever it started too
        resource.setrlimit(resource.RLIMIT_CPU, (cpu_seconds, cpu_seconds))
        resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))

    return apply


def run_python(source: str, timeout: float = 2.0, memory_mb: int = 256) -> SandboxResult:
    if timeout <= 0 or memory_mb <= 0:
        raise ValueError(f"timeout and memory_mb must be > 0; got {timeout}, {memory_mb}")
    with tempfile.TemporaryDirectory(prefix="k3-sandbox-") as tmp:
        proc = subprocess.Popen([sys.executable, "-I", "-S", "-c", source], cwd=tmp, stdin=subprocess.DEVNULL,
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env={},
                                preexec_fn=_limits(max(1, int(timeout + 0.999)), memory_mb << 20))
        try:
            _, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            return SandboxResult(False, None, True, "")
    return SandboxResult(proc.returncode == 0, proc.returncode, False, err.decode("utf-8", "replace")[-2000:])
