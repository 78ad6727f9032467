"""One training process per run directory: ``RUN/train.lock``.

Two trainers on one ``--out`` would interleave their metrics and overwrite each other's checkpoints, so the run
directory is locked for the whole run. The lock is an advisory ``flock`` on ``RUN/train.lock``, held on an open
descriptor: the kernel releases it when the process ends however it ends (kill -9 included), so a dead holder can
never keep a run locked. The file's content says who holds it (pid, host, command, start time): a second trainer
is refused with that line, and one that finds the content of a process that is gone takes the lock over and says
so.

The file is emptied, never deleted, when the run ends: deleting a locked file lets a third process lock a new file
of the same name while a second still waits on the old one, and two runs would then each hold "the" lock.
"""

from __future__ import annotations

import fcntl
import json
import os
import shlex
import socket
import sys
import time
from pathlib import Path

NAME = "train.lock"


class RunLocked(RuntimeError):
    """Another live process trains in this run directory."""


def _describe(holder: dict) -> str:
    return (f"pid {holder.get('pid')} on host {holder.get('host')}, started {holder.get('started')}: "
            f"{holder.get('command')}")


def _read(fd: int) -> dict:
    os.lseek(fd, 0, os.SEEK_SET)
    raw = os.read(fd, 65536).decode("utf-8", errors="replace").strip()
    if not raw:
        return {}
    try:
        holder = json.loads(raw)
    except json.JSONDecodeError:
        return {"command": f"(unreadable lock content {raw[:80]!r})"}
    return holder if isinstance(holder, dict) else {}


def _command() -> str:
    """The command line as typed: ``k3 train ...`` for ``python -m k3`` (whose argv[0] is k3/__main__.py)."""
    first = Path(sys.argv[0]).name if sys.argv else ""
    return shlex.join(["k3", *sys.argv[1:]] if first in ("__main__.py", "k3") else sys.argv)


class RunLock:
    """``with RunLock(run_dir, log):`` holds ``run_dir/train.lock`` or raises RunLocked naming the holder."""

    def __init__(self, run_dir: str | os.PathLike, log=print):
        self.path = Path(run_dir) / NAME
        self.log = log
        self.fd: int | None = None

    def acquire(self) -> None:
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read(fd)
            os.close(fd)
            who = _describe(holder) if holder else "another process (it has not written its name yet)"
            raise RunLocked(f"{self.path.parent} is in use by another training run ({who}); the lock is "
                            f"{self.path}. Wait for that run to end or stop it, or train into another --out "
                            "directory") from None
        old = _read(fd)
        if old:  # a holder that ended without emptying the file: killed, or its machine went down
            self.log(f"taking over the lock {self.path} of a run that is no longer running ({_describe(old)})")
        me = {"pid": os.getpid(), "host": socket.gethostname(), "command": _command(),
              "started": time.strftime("%Y-%m-%d %H:%M:%S")}
        os.ftruncate(fd, 0)
        os.lseek(fd, 0, os.SEEK_SET)
        os.write(fd, (json.dumps(me) + "\n").encode())
        self.fd = fd

    def release(self) -> None:
        if self.fd is None:
            return
        try:
            os.ftruncate(self.fd, 0)
        finally:
            os.close(self.fd)  # closing drops the flock
            self.fd = None

    def __enter__(self) -> "RunLock":
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()
