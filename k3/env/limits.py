"""A sandbox's limits and the kernel mechanisms that enforce them (seed 000 §8.4's AgentENV, on plain Linux).

Each limit has one enforcer, chosen for what it can actually stop:
- processes: the pids cgroup (``pids.max``). RLIMIT_NPROC counts per real uid across the host and root ignores
  it, so it cannot contain a fork bomb here;
- memory: the memory cgroup (``memory.limit_in_bytes``; the kernel OOM-kills inside the group) and RLIMIT_AS
  as a second line where no cgroup is writable;
- CPU time: RLIMIT_CPU per process (SIGXCPU, then SIGKILL), plus the wall clock below;
- file size: RLIMIT_FSIZE (a write past it fails with EFBIG);
- wall time: the caller's timeout, then SIGKILL to the whole cgroup;
- network: a new network namespace with only loopback (bubblewrap's --unshare-net).
The freezer cgroup gives pause/resume (the whole tree stopped, no CPU) and cpuacct measures CPU use.
"""

from __future__ import annotations

import dataclasses
import os
import resource
import signal
import time
from pathlib import Path

CGROOT = Path("/sys/fs/cgroup")
CONTROLLERS = ("freezer", "pids", "memory", "cpuacct")


@dataclasses.dataclass(frozen=True)
class Limits:
    cpu_s: int = 60  # CPU seconds per process
    memory_mb: int = 1024  # the whole sandbox (cgroup), or per process (RLIMIT_AS) without one
    procs: int = 128  # live processes and threads in the sandbox
    file_mb: int = 256  # largest file a process may write
    wall_s: float = 120.0  # default timeout of one exec
    network: bool = False  # False: a private network namespace with loopback only

    def __post_init__(self):
        for f in ("cpu_s", "memory_mb", "procs", "file_mb", "wall_s"):
            if getattr(self, f) <= 0:
                raise ValueError(f"Limits.{f} must be > 0, got {getattr(self, f)}: give a positive limit")

    def apply_rlimits(self, cgroup_memory: bool) -> None:
        """In the child between fork and exec: the per-process limits."""
        resource.setrlimit(resource.RLIMIT_CPU, (self.cpu_s, self.cpu_s + 1))
        size = self.file_mb << 20
        resource.setrlimit(resource.RLIMIT_FSIZE, (size, size))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        if not cgroup_memory:  # address space is a coarse stand-in (it counts mappings, not pages used)
            mem = self.memory_mb << 20
            resource.setrlimit(resource.RLIMIT_AS, (mem, mem))


class Cgroups:
    """One cgroup per controller (cgroup v1, as mounted here) named k3env/<name>; ``available`` says if writable.

    cgroup v2 (one unified tree) would need the same five files under other names; where neither is writable the
    sandbox falls back to SIGSTOP/SIGCONT on its process groups and RLIMIT_AS, and says so in ``Sandbox.info``.
    """

    def __init__(self, name: str, limits: Limits):
        self.dirs = {c: CGROOT / c / "k3env" / name for c in CONTROLLERS}
        try:
            for d in self.dirs.values():
                d.mkdir(parents=True, exist_ok=True)
            (self.dirs["pids"] / "pids.max").write_text(str(limits.procs))
            mem = str(limits.memory_mb << 20)
            (self.dirs["memory"] / "memory.limit_in_bytes").write_text(mem)
            try:  # swap counted too, so a hog cannot page out past the limit
                (self.dirs["memory"] / "memory.memsw.limit_in_bytes").write_text(mem)
            except OSError:
                pass
            self.available = True
        except OSError:
            self.remove()
            self.available = False

    def enter(self) -> None:
        """In the child between fork and exec: join every group (children inherit them)."""
        for d in self.dirs.values():
            (d / "cgroup.procs").write_text(str(os.getpid()))

    def pids(self) -> list[int]:
        try:
            return [int(x) for x in (self.dirs["pids"] / "cgroup.procs").read_text().split()]
        except OSError:
            return []

    def cpu_ns(self) -> int:
        """CPU time used by every process the sandbox ever ran (user + system), in nanoseconds."""
        return int((self.dirs["cpuacct"] / "cpuacct.usage").read_text())

    def memory_failures(self) -> int:
        return int((self.dirs["memory"] / "memory.failcnt").read_text())

    def freeze(self, frozen: bool) -> None:
        state = self.dirs["freezer"] / "freezer.state"
        state.write_text("FROZEN" if frozen else "THAWED")
        if frozen:  # the write starts freezing; FREEZING -> FROZEN once every task has stopped
            for _ in range(2000):
                if state.read_text().strip() == "FROZEN":
                    return
                time.sleep(0.0005)

    def kill_all(self) -> None:
        """SIGKILL everything inside. Frozen first, so a fork bomb cannot fork between the listing and the kill;
        a frozen task takes the signal once thawed."""
        for _ in range(50):
            pids = self.pids()
            if not pids:
                return
            self.freeze(True)
            for p in self.pids():
                try:
                    os.kill(p, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            try:
                (self.dirs["freezer"] / "freezer.state").write_text("THAWED")
            except OSError:
                pass
            time.sleep(0.01)

    def remove(self) -> None:
        for d in self.dirs.values():
            for _ in range(100):
                try:
                    if d.exists():
                        d.rmdir()
                    break
                except OSError:  # busy while the last task is exiting
                    time.sleep(0.01)
