"""Run untrusted Python in a subprocess with a wall-clock limit and memory, CPU, file-size and network limits.

``run_python(source, timeout=2.0, memory_mb=256)`` -> ``SandboxResult(ok, returncode, timed_out, stdout, stderr)``. The
code is written to an empty temporary directory (the child's working directory, removed afterwards) and run by a
fresh interpreter (``python -I -S``: no user site, no site-packages, no environment variables) in its own session,
whose launcher first enters a new user + network namespace (no interfaces: no network; where the kernel forbids
unprivileged namespaces the ``socket`` module is disabled instead) and sets, in the child, RLIMIT_AS (address
space: ``memory_mb``), RLIMIT_CPU (the timeout, rounded up), RLIMIT_FSIZE (1 MiB per file written) and no core
files. The parent waits at most ``timeout`` seconds of wall clock, then kills the child's whole process group;
stdout and stderr go to files, so a child that floods them or leaves a grandchild holding them open cannot block
the parent. Any exception, ``sys.exit`` with a non-zero status, a signal or the timeout is a failure.

It contains mistakes (infinite loops, runaway memory, exceptions), not a determined attacker: the filesystem is
not isolated beyond the working directory, and a child that starts a new session escapes the group kill.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

__all__ = ["SandboxResult", "run_python", "FILE_LIMIT"]

FILE_LIMIT = 1 << 20  # bytes per file the child writes (its stdout and stderr included)

# Runs in the child before the candidate (argv: memory bytes, CPU seconds, file bytes).
_LAUNCHER = r"""
import sys
def _isolate():
    try:
        import ctypes
        return ctypes.CDLL(None, use_errno=True).unshare(0x10000000 | 0x40000000) == 0  # NEWUSER | NEWNET
    except Exception:
        return False
if not _isolate():
    import socket
    def _refuse(*a, **k):
        raise OSError("network access is disabled in the k3 sandbox")
    socket.socket = socket.create_connection = socket.getaddrinfo = socket.socketpair = _refuse
import resource
mem, cpu, fsize = (int(v) for v in sys.argv[1:4])
resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu))
resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
del _isolate, mem, cpu, fsize, resource
sys.argv = ["candidate.py"]
with open("candidate.py", encoding="utf-8") as f:
    _code = compile(f.read(), "candidate.py", "exec")
exec(_code, {"__name__": "__main__", "__builtins__": __builtins__})
"""


@dataclass(frozen=True)
class SandboxResult:
    ok: bool  # exited with status 0 within the limits
    returncode: int | None  # None when killed at the timeout
    timed_out: bool
    stdout: str  # its last 2000 characters
    stderr: str  # its last 2000 characters


def run_python(source: str, timeout: float = 2.0, memory_mb: int = 256) -> SandboxResult:
    if not timeout > 0:
        raise ValueError(f"run_python: timeout must be > 0 seconds; got {timeout!r}")
    if not isinstance(memory_mb, int) or memory_mb < 32:
        raise ValueError(f"run_python: memory_mb must be an integer >= 32 (the interpreter needs ~20 MiB); got "
                         f"{memory_mb!r}")
    with tempfile.TemporaryDirectory(prefix="k3-sandbox-") as tmp:
        Path(tmp, "candidate.py").write_text(source, encoding="utf-8")
        with open(Path(tmp, ".stdout"), "wb+") as out, open(Path(tmp, ".stderr"), "wb+") as err:
            proc = subprocess.Popen(
                [sys.executable, "-I", "-S", "-c", _LAUNCHER, str(memory_mb << 20), str(int(timeout) + 1),
                 str(FILE_LIMIT)], cwd=tmp, stdin=subprocess.DEVNULL, stdout=out, stderr=err, env={},
                start_new_session=True, close_fds=True)
            try:
                proc.wait(timeout=timeout)
                timed_out = False
            except subprocess.TimeoutExpired:
                timed_out = True
            _kill_group(proc.pid)  # also what a finished child left running
            if timed_out:
                proc.wait()
            stdout, stderr = _tail(out), _tail(err)
    if timed_out:
        return SandboxResult(False, None, True, stdout, stderr)
    return SandboxResult(proc.returncode == 0, proc.returncode, False, stdout, stderr)


def _tail(f, chars: int = 2000) -> str:
    f.seek(max(0, f.seek(0, os.SEEK_END) - 4 * chars))
    return f.read().decode("utf-8", "replace")[-chars:]


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
