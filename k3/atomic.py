"""Atomic file writes: a reader (or a process killed mid-write) sees the old file or the new one, never half.

The new content goes to a fresh hidden name in the target's directory and is renamed over the target. Files get
the ordinary mode (0666 minus the umask, as ``open`` gives), not the 0600 of ``mkstemp`` or of writers that make
their own temp files (safetensors' ``save_file``), so k3's outputs are readable by whoever can read the directory.
"""

from __future__ import annotations

import os
import secrets
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

__all__ = ["atomic_path", "write_text_atomic"]


@contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yields an empty temp file next to ``path`` for the caller to (over)write; it is given the ordinary mode and
    renamed onto ``path`` when the block ends normally, removed when it raises."""
    path = Path(path)
    tmp = path.parent / f".{path.name}.{os.getpid()}-{secrets.token_hex(4)}.tmp"
    try:
        with open(tmp, "x"):  # created as open() creates files: the mode the umask allows
            pass
        mode = stat.S_IMODE(tmp.stat().st_mode)
        yield tmp
        os.chmod(tmp, mode)  # a writer may have replaced the file with one of its own making
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_text_atomic(path: str | os.PathLike, text: str) -> None:
    with atomic_path(path) as tmp, open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
