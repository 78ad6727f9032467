"""DockerSandbox: the same interface over a docker daemon (the second backend of issue 45).

Isolation is the container's: ``--network none``, ``--cap-drop ALL``, no-new-privileges, ``--memory`` (swap
included), ``--pids-limit``, and ``--ulimit cpu/fsize``. pause/resume are ``docker pause`` (the freezer cgroup
again); fork and snapshot are ``docker commit`` (an image layer holding the container's changes: incremental,
copy-on-write through the storage driver), restore replaces the container by one from the snapshot's image.
As for the local backend, processes are not captured (see base.py). Everything goes through the ``docker`` CLI,
so k3 needs no docker SDK; ``available()`` says whether a daemon answers.
"""

from __future__ import annotations

import io
import secrets
import shlex
import shutil
import subprocess
import tarfile
import time

from .base import ExecResult, SandboxBase, Snapshot
from .limits import Limits
from .shell import ShellSession

IMAGE = "python:3.11-slim"


def available() -> tuple[bool, str]:
    """(True, "") when a docker daemon answers, else (False, why)."""
    if shutil.which("docker") is None:
        return False, "no docker client on PATH"
    try:
        r = subprocess.run(["docker", "info", "--format", "{{.ServerVersion}}"], capture_output=True, text=True,
                           timeout=10)
    except subprocess.TimeoutExpired:
        return False, "docker info timed out"
    if r.returncode != 0:
        return False, " ".join((r.stderr or r.stdout).split())[:200] or "docker info failed"
    return True, ""


def _docker(*args: str, input: bytes | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    r = subprocess.run(["docker", *args], input=input, capture_output=True, timeout=timeout)
    if r.returncode != 0:
        raise RuntimeError(f"docker {args[0]} failed: {r.stderr.decode(errors='replace').strip()}")
    return r


class DockerSandbox(SandboxBase):
    def __init__(self, container: str, image: str, limits: Limits, env: dict[str, str], cwd: str):
        self.container, self.image, self.limits, self.env, self.cwd = container, image, limits, dict(env), cwd
        self.paused = self.closed = False
        self.violations: list[str] = []
        self._images: list[str] = []  # fork/snapshot images this sandbox made, removed at close
        self._shell: ShellSession | None = None

    @classmethod
    def create(cls, files: dict[str, bytes | str] | None = None, limits: Limits | None = None,
               env: dict[str, str] | None = None, image: str = IMAGE) -> DockerSandbox:
        limits = limits or Limits()
        box = cls(cls._run(image, limits, env or {}), image, limits, env or {}, cls.workspace_path)
        if files:
            buf = io.BytesIO()
            with tarfile.open(fileobj=buf, mode="w") as tar:
                for rel, data in files.items():
                    raw = data.encode() if isinstance(data, str) else data
                    info = tarfile.TarInfo(rel)
                    info.size, info.mtime = len(raw), int(time.time())
                    tar.addfile(info, io.BytesIO(raw))
            _docker("cp", "-", f"{box.container}:{cls.workspace_path}", input=buf.getvalue())
        return box

    @staticmethod
    def _run(image: str, limits: Limits, env: dict[str, str]) -> str:
        mem = f"{limits.memory_mb}m"
        args = ["run", "-d", "--cap-drop", "ALL", "--security-opt", "no-new-privileges", "--memory", mem,
                "--memory-swap", mem, "--pids-limit", str(limits.procs),
                "--ulimit", f"cpu={limits.cpu_s}:{limits.cpu_s + 1}", "--ulimit",
                f"fsize={limits.file_mb << 20}", "-w", "/workspace", "--label", "k3.env=1"]
        if not limits.network:
            args += ["--network", "none"]
        for k, v in env.items():
            args += ["-e", f"{k}={v}"]
        out = _docker(*args, image, "sh", "-c", "mkdir -p /workspace; exec sleep infinity")
        return out.stdout.decode().strip()

    def exec(self, cmd: str, timeout: float | None = None) -> ExecResult:
        t = timeout or self.limits.wall_s
        t0 = time.perf_counter()
        r = subprocess.run(["docker", "exec", "-w", self.cwd, self.container, "timeout", "-s", "KILL", str(t),
                            "bash", "-c", cmd], capture_output=True, timeout=t + 30)
        code = r.returncode
        res = ExecResult(code, r.stdout.decode(errors="replace"), r.stderr.decode(errors="replace"),
                         time.perf_counter() - t0, "wall" if code == 137 and time.perf_counter() - t0 >= t else None)
        if res.violation:
            self.violations.append(res.violation)
        return res

    def shell(self, cmd: str, timeout: float | None = None) -> ExecResult:
        if self._shell is None or not self._shell.alive:
            p = subprocess.Popen(["docker", "exec", "-i", "-w", self.cwd, self.container, "bash", "--noprofile",
                                  "--norc"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
            self._shell = ShellSession(p)
        res = self._shell.run(cmd, timeout or self.limits.wall_s)
        if res.violation == "wall":
            self._stop_shell()
            self.violations.append("wall")
        return res

    def _stop_shell(self) -> None:
        if self._shell is not None:
            self._shell.proc.kill()
            self._shell.proc.wait()
            self._shell.close()
            self._shell = None

    def _path(self, path: str) -> str:
        return path if path.startswith("/") else f"{self.workspace_path}/{path}"

    def read(self, path: str) -> bytes:
        return _docker("exec", self.container, "cat", self._path(path)).stdout

    def write(self, path: str, data: bytes | str) -> None:
        p = shlex.quote(self._path(path))
        _docker("exec", "-i", self.container, "sh", "-c", f"mkdir -p \"$(dirname {p})\" && cat > {p}",
                input=data.encode() if isinstance(data, str) else data)

    def listdir(self, path: str = ".") -> list[str]:
        return sorted(_docker("exec", self.container, "ls", "-A", self._path(path)).stdout.decode().split("\n")[:-1])

    def pause(self) -> None:
        _docker("pause", self.container)
        self.paused = True

    def resume(self) -> None:
        _docker("unpause", self.container)
        self.paused = False

    def _commit(self) -> str:
        tag = f"k3env-{secrets.token_hex(6)}"
        _docker("commit", "--pause=true", self.container, tag)
        self._images.append(tag)
        return tag

    def fork(self) -> DockerSandbox:
        tag = self._commit()
        child = DockerSandbox(self._run(tag, self.limits, self.env), tag, self.limits, self.env, self.cwd)
        return child

    def snapshot(self) -> Snapshot:
        t0 = time.perf_counter()
        tag = self._commit()
        return Snapshot(tag, tag, tuple(sorted(self.env.items())), self.cwd, time.perf_counter() - t0, -1)

    def restore(self, snap: Snapshot) -> None:
        self._stop_shell()
        _docker("rm", "-f", self.container)
        self.env, self.cwd = dict(snap.env), snap.cwd
        self.container = self._run(str(snap.files), self.limits, self.env)

    def close(self) -> None:
        if self.closed:
            return
        self._stop_shell()
        subprocess.run(["docker", "rm", "-f", self.container], capture_output=True)
        for tag in self._images:
            subprocess.run(["docker", "rmi", "-f", tag], capture_output=True)
        self.closed = True
