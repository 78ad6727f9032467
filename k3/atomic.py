"""Atomic file writes: a reader (or a process killed mid-write) sees the old file or the new one, never half.

The new content goes to a fresh hidden name in the target's directory and is renamed over the target. The temp
file is created by the writer with the ordinary mode (0666 minus the umask, as ``open`` does), not ``mkstemp``'s
0600, so the files k3 writes are readable by whoever can read the directory, like any other output.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

__all__ = ["atomic_path", "write_text_atomic"]


@contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yields a temp path next to ``path`` (not yet created) for the caller to write; renamed onto ``path`` when
    the block ends normally, removed when it raises."""
    path = Path(path)
    tmp = path.parent / f".{path.name}.{os.getpid()}-{secrets.token_hex(4)}.tmp"
    try:
        yield tmp
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_text_atomic(path: str | os.PathLike, text: str) -> None:
    with atomic_path(path) as tmp, open(tmp, "x", encoding="utf-8") as f:
        f.write(text)
