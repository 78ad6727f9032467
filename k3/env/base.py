"""The sandbox interface every backend implements (local bubblewrap, docker), and what its calls return.

What a snapshot captures, for every backend: the workspace's files (contents, modes, symlinks, deletions of base
files) and the sandbox's environment variables and working directory. Live processes are NOT captured: restore
and fork start a fresh persistent shell in the restored files (a process's memory would need CRIU, which the
issue's peers report fragile in containers). Files outside the workspace (the sandbox's private /tmp) are not
captured either.
"""

from __future__ import annotations

import abc
import dataclasses
from pathlib import Path


@dataclasses.dataclass
class ExecResult:
    exit_code: int  # the command's status; 124 after the wall clock, 128 + n after signal n
    stdout: str
    stderr: str
    seconds: float
    violation: str | None = None  # a limit broken: "wall", "memory", "procs", "cpu" or "file_size"

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and self.violation is None


@dataclasses.dataclass(frozen=True)
class Snapshot:
    id: str
    files: Path | str  # where the backend keeps the captured files (a directory, or an image name)
    env: tuple[tuple[str, str], ...]
    cwd: str
    seconds: float  # how long taking it took
    copied_bytes: int  # bytes copied (the rest hard-linked to the previous snapshot)
    layers: tuple = ()  # local backend: this snapshot's layer, then the layers it sits on (top first)


class SandboxBase(abc.ABC):
    """An isolated workspace and process tree. Paths given to read/write/listdir are relative to the workspace
    (an absolute path must lie inside it); commands run with the workspace as the working directory."""

    workspace_path = "/workspace"  # what the sandboxed processes see

    @abc.abstractmethod
    def exec(self, cmd: str, timeout: float | None = None) -> ExecResult:
        """Run ``cmd`` with bash in a fresh process tree inside the sandbox."""

    @abc.abstractmethod
    def shell(self, cmd: str, timeout: float | None = None) -> ExecResult:
        """Run ``cmd`` in the sandbox's persistent shell: cd, exports and background jobs carry over."""

    @abc.abstractmethod
    def read(self, path: str) -> bytes: ...

    @abc.abstractmethod
    def write(self, path: str, data: bytes | str) -> None: ...

    @abc.abstractmethod
    def listdir(self, path: str = ".") -> list[str]: ...

    @abc.abstractmethod
    def pause(self) -> None:
        """Stop every process of the sandbox; a paused sandbox uses no CPU."""

    @abc.abstractmethod
    def resume(self) -> None: ...

    @abc.abstractmethod
    def fork(self) -> SandboxBase:
        """A copy whose changes never reach this sandbox, and the other way round."""

    @abc.abstractmethod
    def snapshot(self) -> Snapshot: ...

    @abc.abstractmethod
    def restore(self, snap: Snapshot) -> None: ...

    @abc.abstractmethod
    def close(self) -> None:
        """Kill every process and delete every file; closing twice is a no-op."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
