"""A persistent bash session over pipes: state (cwd, exports, background jobs) carries over between commands.

Each command is sent as ``{ cmd\n} </dev/null`` followed by a marker carrying a random token and ``$?`` on both
streams, so the reader knows where one command's output ends and what it returned. stdin is /dev/null so a
command cannot swallow the next protocol line. A command that outlives its timeout takes the session with it
(the caller kills the session's process tree and starts a new one).
"""

from __future__ import annotations

import os
import secrets
import selectors
import subprocess
import time

from .base import ExecResult


class ShellSession:
    def __init__(self, proc: subprocess.Popen):
        self.proc = proc
        for f in (proc.stdout, proc.stderr):
            os.set_blocking(f.fileno(), False)

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def run(self, cmd: str, timeout: float) -> ExecResult:
        token = secrets.token_hex(8)
        marker = f"\x1fK3END{token}"
        script = (f"{{ {cmd}\n}} </dev/null\n__k3_rc=$?\nprintf '\\n{marker} %d\\n' $__k3_rc\n"
                  f"printf '\\n{marker}\\n' >&2\n")
        t0 = time.perf_counter()
        try:
            self.proc.stdin.write(script.encode())
            self.proc.stdin.flush()
        except BrokenPipeError:
            return ExecResult(137, "", "the shell session ended", time.perf_counter() - t0, None)
        bufs = {self.proc.stdout.fileno(): b"", self.proc.stderr.fileno(): b""}
        done: dict[int, bool] = dict.fromkeys(bufs, False)
        sel = selectors.DefaultSelector()
        for fd in bufs:
            sel.register(fd, selectors.EVENT_READ)
        needle = marker.encode()
        try:
            while not all(done.values()):
                left = timeout - (time.perf_counter() - t0)
                if left <= 0:
                    return ExecResult(124, self._text(bufs, 0), self._text(bufs, 1), time.perf_counter() - t0,
                                      "wall")
                events = sel.select(min(left, 0.5))
                if not events and not self.alive:
                    return ExecResult(137, self._text(bufs, 0), self._text(bufs, 1),
                                      time.perf_counter() - t0, None)
                for key, _ in events:
                    chunk = os.read(key.fd, 1 << 16)
                    if not chunk:
                        done[key.fd] = True
                        continue
                    bufs[key.fd] += chunk
                    done[key.fd] = needle in bufs[key.fd]
        finally:
            sel.close()
        out_fd, err_fd = list(bufs)
        out, _, tail = bufs[out_fd].partition(b"\n" + needle)
        err = bufs[err_fd].partition(b"\n" + needle)[0]
        try:
            rc = int(tail.split()[0])
        except (IndexError, ValueError):
            rc = 1
        return ExecResult(rc, out.decode(errors="replace"), err.decode(errors="replace"), time.perf_counter() - t0)

    @staticmethod
    def _text(bufs: dict, i: int) -> str:
        return list(bufs.values())[i].decode(errors="replace")

    def close(self) -> None:
        for f in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            try:
                f.close()
            except OSError:
                pass
