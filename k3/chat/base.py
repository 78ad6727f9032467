"""What every chat format shares: the error it raises, the events its reply parser emits, the prompt it returns,
and the checks of a request's ``tools`` / ``tool_choice``."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["ChatError", "OutputEvent", "PlainOutput", "ChatPrompt", "tool_name_of_call", "tools_by_name",
           "check_tool_choice", "refuse_tools_and_effort", "encode", "next_marker"]


class ChatError(ValueError):
    """Messages or tools a chat format cannot render; ``param`` names the request field."""

    def __init__(self, message: str, param: str = "messages"):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class OutputEvent:
    """A piece of the assistant's message: ``kind`` "content" / "reasoning" (``text``), "tool_call" (``text`` = the
    arguments as JSON, ``name``, ``id``), or "error" (``text`` = malformed tool output, returned as content, and
    ``name`` = what was wrong)."""

    kind: str
    text: str
    name: str = ""
    id: str = ""


class PlainOutput:
    """A format without tool calls: all text is content."""

    def feed(self, text: str) -> list[OutputEvent]:
        return [OutputEvent("content", text)] if text else []

    def finish(self) -> list[OutputEvent]:
        return []


@dataclass
class ChatPrompt:
    ids: list[int]
    parser: Any  # feed(text) / finish() -> list[OutputEvent]


def tool_name_of_call(call: Mapping) -> str:
    return (call.get("function") or {}).get("name", "")


def tools_by_name(tools: Sequence[Mapping] | None) -> dict[str, dict]:
    return {t["function"]["name"]: dict(t) for t in tools or ()}


def check_tool_choice(tools: Sequence[Mapping] | None, tool_choice: Any) -> None:
    if isinstance(tool_choice, Mapping):
        name = (tool_choice.get("function") or {}).get("name")
        if name not in tools_by_name(tools):
            raise ChatError(f"tool_choice names the function {name!r}, which is not among the tools "
                            f"{sorted(tools_by_name(tools))}", "tool_choice")
    elif tool_choice == "required" and not tools:
        raise ChatError("tool_choice 'required' needs tools", "tool_choice")


def refuse_tools_and_effort(fmt: str, tools, tool_choice, reasoning_effort) -> None:
    """A format without tool calls or a thinking channel refuses both, naming the field."""
    if tools and tool_choice != "none":
        raise ChatError(f"this model's chat format ({fmt}) has no tool-call format: k3 cannot tell its tool calls "
                        "from text; leave tools out, or serve a model whose tokenizer has K3's chat format", "tools")
    if reasoning_effort is not None:
        raise ChatError(f"reasoning_effort is not supported by this model's chat format ({fmt}); leave it out",
                        "reasoning_effort")


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False).ids


def next_marker(buf: str, markers: tuple[str, ...]) -> tuple[str, str | None, str]:
    """(the text before the first of ``markers`` in ``buf``, that marker, the text after it); with none there,
    (the text that can no longer become part of a marker, None, the suffix held back because it still could)."""
    hits = [(buf.find(m), m) for m in markers if m in buf]
    if not hits:
        keep = _partial_suffix(buf, markers)
        return buf[:len(buf) - keep], None, buf[len(buf) - keep:]
    at, marker = min(hits)
    return buf[:at], marker, buf[at + len(marker):]


def _partial_suffix(text: str, markers: tuple[str, ...]) -> int:
    """Length of the longest suffix of ``text`` that could still grow into one of ``markers``."""
    for n in range(min(len(text), max((len(m) for m in markers), default=1) - 1), 0, -1):
        if any(m.startswith(text[-n:]) for m in markers):
            return n
    return 0
