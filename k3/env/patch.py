"""The apply-patch protocol (Codex's envelope): one patch adds, deletes and updates files by context hunks.

    *** Begin Patch
    *** Add File: path          every following line starts with '+'
    *** Delete File: path
    *** Update File: path       then hunks: '@@' lines, and lines starting ' ' (context), '-' (old), '+' (new)
    *** End Patch

A hunk applies where its old side (context and '-' lines, in order) occurs exactly once in the file; the new
side (context and '+' lines) replaces it. Parsing and text edits run in k3's process on the file's text (no
code is run); the files are read and written through the sandbox.
"""

from __future__ import annotations

from .base import SandboxBase


def _parse(patch: str) -> list[tuple[str, str, list[str]]]:
    lines = patch.strip("\n").split("\n")
    if not lines or lines[0].strip() != "*** Begin Patch" or lines[-1].strip() != "*** End Patch":
        raise ValueError("the patch must start with '*** Begin Patch' and end with '*** End Patch'")
    ops, cur = [], None
    for line in lines[1:-1]:
        for kind in ("Add", "Delete", "Update"):
            head = f"*** {kind} File: "
            if line.startswith(head):
                cur = (kind, line[len(head):].strip(), [])
                ops.append(cur)
                break
        else:
            if cur is None:
                raise ValueError(f"patch line {line!r} comes before any '*** Add/Delete/Update File:' header")
            cur[2].append(line)
    return ops


def _hunks(body: list[str]) -> list[tuple[list[str], list[str]]]:
    hunks, old, new = [], [], []
    for line in body + ["@@"]:
        if line.startswith("@@"):
            if old or new:
                hunks.append((old, new))
            old, new = [], []
        elif line.startswith("-"):
            old.append(line[1:])
        elif line.startswith("+"):
            new.append(line[1:])
        else:  # context: a leading space (or an empty line, which editors strip to nothing)
            old.append(line[1:])
            new.append(line[1:])
    return hunks


def apply_patch(sandbox: SandboxBase, patch: str) -> str:
    """Apply ``patch`` to the sandbox's workspace; returns a one-line summary. All hunks are checked first."""
    writes: dict[str, str | None] = {}
    for kind, path, body in _parse(patch):
        if kind == "Add":
            bad = [b for b in body if not b.startswith("+")]
            if bad:
                raise ValueError(f"Add File {path}: every line must start with '+', not {bad[0]!r}")
            writes[path] = "".join(b[1:] + "\n" for b in body)
        elif kind == "Delete":
            writes[path] = None
        else:
            text = writes.get(path) or sandbox.read(path).decode()
            for i, (old, new) in enumerate(_hunks(body)):
                o, n = "\n".join(old) + "\n", "\n".join(new) + "\n"
                count = text.count(o)
                if count != 1:
                    raise ValueError(f"Update File {path}, hunk {i + 1}: its old lines occur {count} times in the "
                                     "file; give more context lines so they occur exactly once")
                text = text.replace(o, n)
            writes[path] = text
    for path, text in writes.items():
        if text is None:
            sandbox.exec(f"rm -f -- '{path}'")
        else:
            sandbox.write(path, text)
    return f"patched {len(writes)} file(s): " + ", ".join(writes)


def render_replace(path: str, text: str, old: str, new: str) -> str:
    """A patch doing ``text.replace(old, new)`` with whole lines (what a model in this protocol would write)."""
    start = text.index(old)
    a = text.rfind("\n", 0, start) + 1
    end = start + len(old) if old.endswith("\n") else text.find("\n", start + len(old)) + 1
    b = len(text) if end <= 0 else end
    before, after = text[a:b], text[a:start] + new + text[start + len(old):b]
    body = [f"-{x}" for x in before.rstrip("\n").split("\n")] + [f"+{x}" for x in after.rstrip("\n").split("\n")]
    return "*** Begin Patch\n*** Update File: " + path + "\n@@\n" + "\n".join(body) + "\n*** End Patch\n"


def render_write(path: str, content: str, exists: bool) -> str:
    lines = [f"+{x}" for x in content.rstrip("\n").split("\n")]
    head = f"*** Delete File: {path}\n" if exists else ""
    return "*** Begin Patch\n" + head + f"*** Add File: {path}\n" + "\n".join(lines) + "\n*** End Patch\n"
