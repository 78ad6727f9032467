"""Documents to train on: the embedded default corpus (the interpreter's own standard library) and user files.

The default corpus needs no download: every ``*.py`` under ``sysconfig.get_paths()["stdlib"]`` (without
``site-packages`` / ``dist-packages``), one document per file, in sorted relative-path order. CPython 3.11 ships
about 30 MB of it: enough to train a small tokenizer and a small model end to end on any machine.

User text (``load_documents``) is cut into documents of at most ``max_chars`` characters at blank lines
(``split_text``): a book in one file becomes many documents, so the train/validation split, which goes by
document, has something to split.
"""

from __future__ import annotations

import json
import os
import re
import sysconfig
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Document", "stdlib_documents", "load_documents", "split_text", "TEXT_SUFFIXES"]

EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages"})
TEXT_SUFFIXES = (".txt", ".md", ".py", ".rst")  # what load_documents takes from a directory


@dataclass(frozen=True)
class Document:
    """One training document. ``id`` is stable across runs (a relative path or file:line) and drives the split."""

    id: str
    text: str


def _walk(root: Path, suffixes: tuple[str, ...], skip_dirs=frozenset(), skip_hidden=False) -> list[str]:
    """Sorted relative POSIX paths of the files under ``root`` ending in ``suffixes``; dir symlinks not followed."""
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in skip_dirs and not (skip_hidden and d.startswith("."))]
        rel_dir = Path(dirpath).relative_to(root)
        for name in filenames:
            if name.endswith(suffixes) and not (skip_hidden and name.startswith(".")):
                found.append((rel_dir / name).as_posix())
    return sorted(found)


def _read(path: Path) -> str:
    """The standard library's sources: a few are in other encodings, read with replacement characters."""
    return path.read_text(encoding="utf-8", errors="replace")


DATA_IS_TEXT = "--data takes UTF-8 text: a text file, a .jsonl file or a directory of text files"


def read_text_file(path: Path, name: str | None = None, want: str = DATA_IS_TEXT) -> str:
    """A user's text file, which must be UTF-8 text: a binary file (NUL bytes) or one in another encoding is
    refused naming the file (``name``, default its path), the first offending byte and ``want``, what to give,
    never read as replacement characters."""
    data = path.read_bytes()
    where = name or str(path)
    nul = data.find(b"\0")
    if nul >= 0:
        raise ValueError(f"{where} is a binary file, not text (a NUL byte at offset {nul}); {want}")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{where} is not UTF-8 text (byte 0x{data[e.start]:02x} at offset {e.start}); convert it, "
                         f"e.g. iconv -f latin1 -t utf-8 {path} > {path.stem}.utf8{path.suffix}; {want}") from None


def check_unicode(value, where: str, field: str = "") -> None:
    """Refuse a lone surrogate (``"\\ud800"`` in JSON) anywhere in ``value``'s strings, naming ``where`` (file:line)
    and the field: such a string is not Unicode text and cannot be encoded to UTF-8 for the tokenizer."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:
            at = f' in "{field}"' if field else ""
            raise ValueError(f"{where}: a lone surrogate \\u{ord(value[e.start]):04x}{at} (at character {e.start}) "
                             "is not Unicode text; remove that escape or write the character it was meant to be "
                             "(a pair such as \\ud83d\\ude00 is fine)") from None
    elif isinstance(value, dict):
        for k, v in value.items():
            check_unicode(k, where, field)
            check_unicode(v, where, f"{field}.{k}" if field else str(k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            check_unicode(v, where, f"{field}[{i}]")


def stdlib_documents(max_bytes: int | None = None) -> list[Document]:
    """The standard library's ``*.py`` files as documents (id = path relative to the stdlib root).

    ``max_bytes`` (UTF-8 bytes of text) keeps a deterministic subset: files are taken in sorted order, and a
    file that would overflow the budget is skipped (not cut), so the subset spreads over many small files.
    """
    if max_bytes is not None and max_bytes <= 0:
        raise ValueError(f"max_bytes must be positive (or None for the whole corpus); got {max_bytes}")
    root = Path(sysconfig.get_paths()["stdlib"])
    if not root.is_dir():
        raise FileNotFoundError(f"the standard library directory {root} does not exist; "
                                "pass your own corpus with load_documents(path) instead")
    docs, used = [], 0
    for rel in _walk(root, (".py",), skip_dirs=EXCLUDED_DIRS):
        path = root / rel
        if max_bytes is not None and path.stat().st_size > max_bytes - used:
            continue
        text = _read(path)
        n = len(text.encode("utf-8"))
        if n == 0 or (max_bytes is not None and used + n > max_bytes):
            continue
        docs.append(Document(rel, text))
        used += n
    if not docs:
        raise ValueError(f"no non-empty *.py files found under {root} (max_bytes={max_bytes}); "
                         "pass your own corpus with load_documents(path) instead")
    return docs


def leading_documents(documents, max_bytes: int) -> list[Document]:
    """The first documents, in order, up to and including the one whose text reaches ``max_bytes`` characters in
    all (a deterministic prefix: what a tokenizer is learned from, or a capped corpus)."""
    kept, total = [], 0
    for d in documents:
        kept.append(d)
        total += len(d.text)
        if total >= max_bytes:
            break
    return kept


_BLANK_LINES = re.compile(r"\n[ \t]*\n\s*")  # a paragraph break: a blank line and any whitespace after it


def _cut(text: str, max_chars: int, sep: re.Pattern | None) -> list[str]:
    """Consecutive pieces of ``text`` (concatenating to it) cut after ``sep`` matches, each piece as long as
    possible up to ``max_chars``; a unit longer than that is cut at line ends, then anywhere."""
    if len(text) <= max_chars:
        return [text]
    if sep is None:
        return [text[i:i + max_chars] for i in range(0, len(text), max_chars)]
    ends = [m.end() for m in sep.finditer(text)] + [len(text)]
    units = [text[a:b] for a, b in zip([0] + ends, ends) if b > a]
    finer = re.compile(r"\n") if sep is _BLANK_LINES else None
    pieces, cur = [], ""
    for u in units:
        if len(cur) + len(u) <= max_chars:
            cur += u
            continue
        if cur:
            pieces.append(cur)
        cur = ""
        if len(u) <= max_chars:
            cur = u
        else:
            pieces.extend(_cut(u, max_chars, finer))
    return pieces + [cur] if cur else pieces


def split_text(text: str, max_chars: int) -> list[str]:
    """``text`` cut at paragraph breaks (blank lines) into pieces of at most ``max_chars`` characters, as few
    as greedy packing of whole paragraphs allows; a longer paragraph is cut at line ends, a longer line anywhere.
    The pieces concatenate back to ``text``; pieces of whitespace only are dropped."""
    if max_chars < 1:
        raise ValueError(f"max_chars must be >= 1; got {max_chars}")
    return [p for p in _cut(text, max_chars, _BLANK_LINES) if p.strip()]


def _split(doc: Document, max_chars: int | None) -> list[Document]:
    if max_chars is None or len(doc.text) <= max_chars:
        return [doc]
    return [Document(f"{doc.id}#{i}", t) for i, t in enumerate(split_text(doc.text, max_chars))]


def load_documents(path: str | os.PathLike, max_chars: int | None = None) -> list[Document]:
    """Documents from ``path``: a ``.jsonl`` file (one ``{"text": ...}`` object per line, optional string
    ``"id"``), a directory (every *.txt, *.md, *.py, *.rst below it, sorted; hidden entries skipped; ids are
    relative paths), or any other file (one document, id = its name). Empty documents are dropped.
    ``max_chars``: a document longer than this is cut at blank lines (``split_text``) into documents with ids
    ``<id>#0``, ``<id>#1``, ...; None keeps every document whole."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"corpus path {str(path)!r} does not exist; expected a text file, a .jsonl file "
                                "or a directory of text files")
    if path.is_dir():
        docs = [Document(rel, t) for rel in _walk(path, TEXT_SUFFIXES, skip_hidden=True)
                if (t := read_text_file(path / rel))]
        if not docs:
            raise ValueError(f"directory {str(path)!r} holds no non-empty text files; expected files ending in "
                             f"{', '.join(TEXT_SUFFIXES)} (searched recursively, hidden entries skipped)")
    elif path.suffix == ".jsonl":
        docs = _load_jsonl(path)
    else:
        text = read_text_file(path)
        if not text:
            raise ValueError(f"corpus file {str(path)!r} is empty; give a file with text in it")
        docs = [Document(path.name, text)]
    return [piece for d in docs for piece in _split(d, max_chars)]


def jsonl_objects(path: Path, example: str):
    """(line number, "path:line", object) of each non-blank line of a JSONL file; a line that is not UTF-8, no
    JSON, or holds a lone surrogate escape is refused naming its file:line (and ``example``, what a line should
    look like)."""
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, start=1):
            where = f"{path}:{lineno}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(f"{where}: not UTF-8 text (byte 0x{raw[e.start]:02x} at column {e.start + 1}); "
                                 "a JSONL file must be UTF-8: fix or remove that line") from None
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: not valid JSON ({e.msg}); each line must be an object like "
                                 f"{example}") from None
            check_unicode(obj, where)
            yield lineno, where, obj


def _load_jsonl(path: Path) -> list[Document]:
    docs = []
    for lineno, where, obj in jsonl_objects(path, '{"text": "..."}'):
        if not isinstance(obj, dict) or not isinstance(obj.get("text"), str):
            got = (f"a JSON {type(obj).__name__}" if not isinstance(obj, dict) else
                   "no \"text\" field" if "text" not in obj else f'"text" of type {type(obj["text"]).__name__}')
            raise ValueError(f'{where}: expected an object with a string "text" field; got {got}. '
                             'Each line must look like {"text": "..."}')
        doc_id = obj["id"] if isinstance(obj.get("id"), str) else f"{path.name}:{lineno}"
        if obj["text"]:
            docs.append(Document(doc_id, obj["text"]))
    if not docs:
        raise ValueError(f'{path} holds no documents with non-empty "text"; expected one {{"text": ...}} per line')
    return docs
