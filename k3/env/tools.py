"""The harness's tools: each a JSON schema (OpenAI's function format) and what it does in the sandbox.

A harness configuration picks a subset by name; the two shipped configurations differ in schema and protocol:
``edit`` (Claude-Code-like: ``bash`` with a command string, ``view``, ``create``, ``str_replace``) and ``patch``
(Codex-like: ``shell`` with an argv list, ``apply_patch``). ``search``, ``submit``, ``remember``, ``skill`` and
``subagent`` are shared. A tool returns text for the model; a bad call returns an error text naming the field
(the model reads it and can retry), it never raises into the loop.
"""

from __future__ import annotations

import dataclasses
import shlex
from typing import Any, Callable

from .patch import apply_patch


@dataclasses.dataclass(frozen=True)
class Tool:
    name: str
    description: str
    parameters: dict  # JSON schema of the arguments object
    run: Callable[[Any, dict], str]  # (episode context, arguments) -> text for the model

    def spec(self) -> dict:
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                 "parameters": self.parameters}}


def _obj(required: list[str], **props) -> dict:
    return {"type": "object", "properties": props, "required": required, "additionalProperties": False}


S, I = {"type": "string"}, {"type": "integer"}


def _clip(text: str, n: int) -> str:
    return text if len(text) <= n else text[: n // 2] + f"\n... [{len(text) - n} chars cut] ...\n" + text[-n // 2:]


def _result(ctx, r) -> str:
    out = _clip(r.stdout, ctx.config.tool_output_chars) + (
        f"\n[stderr]\n{_clip(r.stderr, ctx.config.tool_output_chars // 2)}" if r.stderr else "")
    tail = f"\n[exit {r.exit_code}" + (f", limit broken: {r.violation}" if r.violation else "") + "]"
    return out + tail


def _bash(ctx, a):
    return _result(ctx, ctx.sandbox.shell(a["command"], timeout=min(a.get("timeout", 60), ctx.config.max_exec_s)))


def _shell_argv(ctx, a):
    argv = a["command"]
    if not isinstance(argv, list) or not all(isinstance(x, str) for x in argv):
        return "error: command must be a list of strings, e.g. [\"bash\", \"-lc\", \"ls\"]"
    return _result(ctx, ctx.sandbox.shell(shlex.join(argv), timeout=ctx.config.max_exec_s))


def _view(ctx, a):
    path = a["path"]
    r = ctx.sandbox.exec(f"test -d {shlex.quote(path)} && ls -la {shlex.quote(path)}")
    if r.exit_code == 0:
        return r.stdout
    lines = ctx.sandbox.read(path).decode(errors="replace").split("\n")
    lo, hi = max(a.get("start", 1), 1), min(a.get("end", len(lines)), len(lines))
    return _clip("\n".join(f"{i:5d}\t{lines[i - 1]}" for i in range(lo, hi + 1)), ctx.config.tool_output_chars)


def _create(ctx, a):
    ctx.sandbox.write(a["path"], a["content"])
    return f"wrote {len(a['content'])} chars to {a['path']}"


def _replace(ctx, a):
    text = ctx.sandbox.read(a["path"]).decode()
    n = text.count(a["old_str"])
    if n != 1:
        return f"error: old_str occurs {n} times in {a['path']}; it must occur exactly once (add context lines)"
    ctx.sandbox.write(a["path"], text.replace(a["old_str"], a["new_str"]))
    return f"replaced 1 occurrence in {a['path']}"


def _patch(ctx, a):
    return apply_patch(ctx.sandbox, a["patch"])


def _search(ctx, a):
    r = ctx.sandbox.exec(f"grep -rnI --exclude-dir=.k3 -e {shlex.quote(a['pattern'])} "
                         f"{shlex.quote(a.get('path', '.'))} | head -100")
    return r.stdout or "no matches"


def _submit(ctx, a):
    return ctx.submit()


def _remember(ctx, a):
    return ctx.remember(a["note"])


def _skill(ctx, a):
    text = ctx.config.skills.get(a["name"])
    return text if text is not None else f"error: no skill {a['name']!r}; skills: {', '.join(ctx.config.skills)}"


def _subagent(ctx, a):
    return ctx.subagent(a["task"])


TOOLS = {t.name: t for t in [
    Tool("bash", "Run a bash command in the persistent shell (cwd and exports carry over). Returns output and exit "
         "code.", _obj(["command"], command=S, timeout=I), _bash),
    Tool("shell", "Run a command given as an argv list, e.g. [\"bash\", \"-lc\", \"ls -la\"].",
         _obj(["command"], command={"type": "array", "items": S}), _shell_argv),
    Tool("view", "Show a file with line numbers (optionally lines start..end), or list a directory.",
         _obj(["path"], path=S, start=I, end=I), _view),
    Tool("create", "Create or overwrite a file with the given content.", _obj(["path", "content"], path=S, content=S),
         _create),
    Tool("str_replace", "Replace old_str, which must occur exactly once in the file, by new_str.",
         _obj(["path", "old_str", "new_str"], path=S, old_str=S, new_str=S), _replace),
    Tool("apply_patch", "Edit files with a patch: '*** Begin Patch', then '*** Add File: p' (lines '+'), "
         "'*** Delete File: p' or '*** Update File: p' with '@@' hunks of ' ' context, '-' old and '+' new "
         "lines, then '*** End Patch'.", _obj(["patch"], patch=S), _patch),
    Tool("search", "Search files for a regular expression (grep -rn); returns matching lines.",
         _obj(["pattern"], pattern=S, path=S), _search),
    Tool("submit", "Submit the workspace for checking. Returns the public checks' feedback; submissions are "
         "limited.", _obj([]), _submit),
    Tool("remember", "Append a note to the memory file that later episodes see.", _obj(["note"], note=S), _remember),
    Tool("skill", "Read the full instructions of a named skill.", _obj(["name"], name=S), _skill),
    Tool("subagent", "Delegate a self-contained sub-task to a subagent with its own context and a small budget; "
         "returns its final answer.", _obj(["task"], task=S), _subagent),
]}


def call(ctx, name: str, arguments: str | dict) -> str:
    """Run one tool call; every failure becomes text the model can act on."""
    import json

    if name not in ctx.tools:
        return f"error: no tool named {name!r}; tools: {', '.join(ctx.tools)}"
    try:
        args = json.loads(arguments or "{}") if isinstance(arguments, str) else dict(arguments)
    except json.JSONDecodeError as e:
        return f"error: arguments are not JSON ({e}); send an object matching the tool's schema"
    tool = ctx.tools[name]
    if not isinstance(args, dict):
        return "error: arguments must be a JSON object"
    missing = [k for k in tool.parameters["required"] if k not in args]
    if missing:
        return f"error: {name} needs the argument(s) {', '.join(missing)}"
    try:
        return tool.run(ctx, args)
    except (ValueError, OSError, UnicodeDecodeError, KeyError, TypeError) as e:
        return f"error: {e}"
