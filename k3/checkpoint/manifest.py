"""SHA-256 checksums of a checkpoint's files: recorded when they are written, verified when they are read.

``SHA256SUMS`` in the checkpoint directory, one ``<64 hex digits>  <file name>`` line per file (the format of
coreutils' ``sha256sum``, so ``cd ckpt && sha256sum -c SHA256SUMS`` checks it by hand too). It is rewritten
atomically after the files it lists. A file whose bytes no longer hash to its entry (a flipped bit, a truncation,
an edit) is refused on load with its name; files without an entry (a directory written by another tool, the
official release, a tokenizer copied in later) load unverified, since nothing was recorded for them.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable
from pathlib import Path

from ..atomic import write_text_atomic
from .errors import CheckpointError

__all__ = ["MANIFEST", "file_sha256", "read_checksums", "record_checksums", "forget_checksums", "verify_checksums"]

MANIFEST = "SHA256SUMS"
_LINE = re.compile(r"^([0-9a-f]{64}) [ *](.+)$")


def file_sha256(path: str | Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def read_checksums(directory: str | Path) -> dict[str, str]:
    """{file name: sha256 hex} from ``directory/SHA256SUMS``; {} when there is none."""
    path = Path(directory) / MANIFEST
    if not path.exists():
        return {}
    entries = {}
    for lineno, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), start=1):
        m = _LINE.match(line)
        if not m:
            raise CheckpointError(f"{path}:{lineno} is not a checksum line ('<64 hex digits>  <file name>'): the "
                                  "manifest is corrupt; restore it, or load without verification (--no-verify)")
        entries[m.group(2)] = m.group(1)
    return entries


def _write(directory: Path, entries: dict[str, str]) -> None:
    write_text_atomic(directory / MANIFEST, "".join(f"{h}  {n}\n" for n, h in sorted(entries.items())))


def _entries_to_keep(directory: Path) -> dict[str, str]:
    try:
        entries = read_checksums(directory)
    except CheckpointError:  # a damaged manifest is replaced, not trusted
        entries = {}
    return {n: h for n, h in entries.items() if (directory / n).is_file()}


def forget_checksums(directory: str | Path, names: Iterable[str]) -> None:
    """Drop the entries of files about to be rewritten, so that a crash between rewriting them and recording
    their new sums leaves them unverified instead of reported as corrupt."""
    d, names = Path(directory), set(names)
    if (d / MANIFEST).exists():
        _write(d, {n: h for n, h in _entries_to_keep(d).items() if n not in names})


def record_checksums(directory: str | Path, names: Iterable[str]) -> None:
    """Hash ``names`` (files in ``directory``) into the manifest, keeping the entries of other files that still
    exist and dropping those of files that are gone."""
    d = Path(directory)
    entries = _entries_to_keep(d)
    entries.update({n: file_sha256(d / n) for n in names})
    _write(d, entries)


def verify_checksums(directory: str | Path, names: Iterable[str] | None = None) -> None:
    """Raise CheckpointError naming the first file whose sha256 differs from its entry. ``names``: the files
    about to be read (those without an entry are skipped); None checks every entry (a listed file that is
    missing is an error then)."""
    d = Path(directory)
    entries = read_checksums(d)
    for name in sorted(entries if names is None else set(names) & set(entries)):
        path = d / name
        if not path.is_file():
            raise CheckpointError(f"{path} is listed in {d / MANIFEST} but missing: the checkpoint is incomplete")
        if file_sha256(path) != entries[name]:
            raise CheckpointError(f"{path} does not match its sha256 in {MANIFEST}: the file is truncated or corrupt "
                                  "(changed since it was written); restore it, or load without verification "
                                  "(--no-verify) at your own risk")
