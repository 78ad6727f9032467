"""Hermes-style tool calls for ChatML (k3/chat/chatml.py): the convention Qwen2.5's chat template writes and vLLM's
``hermes`` tool parser reads, so a k3 checkpoint trained on ChatML takes OpenAI ``tools`` as those models do.

- The tools go into the system turn (after the request's own system message, if it sends one first)::

      # Tools

      You may call one or more functions to assist with the user query.

      You are provided with function signatures within <tools></tools> XML tags:
      <tools>
      {"type": "function", "function": {...}}          <- one tool per line, as JSON
      </tools>

      For each function call, return a json object with function name and arguments within <tool_call></tool_call>
      XML tags:
      <tool_call>
      {"name": <function-name>, "arguments": <args-json-object>}
      </tool_call>

- An assistant's ``tool_calls`` follow its content, one
  ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`` each, joined by newlines
  (arguments as a JSON object; an ``arguments`` string that is not JSON is written as that string, so nothing is
  lost).
- ``role: "tool"`` messages become one user turn per run of consecutive results:
  ``<tool_response>\\n{content}\\n</tool_response>`` each, joined by newlines.
- ``HermesOutput`` streams the reply apart: text outside ``<tool_call>...</tool_call>`` is content; each call's body
  must be one JSON object with a declared ``name`` and an object ``arguments``; anything else (bad JSON, an undeclared
  tool, a call not closed when the output ends) is returned as content with the reason ("error" event), never
  dropped.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from .base import OutputEvent, next_marker, tool_name_of_call

__all__ = ["HermesOutput", "tools_system_block", "render_tool_calls", "render_tool_results", "parse_tool_call",
           "forced_prefix", "CALL_OPEN", "CALL_CLOSE"]

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
_TOOLS_HEAD = ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
               "You are provided with function signatures within <tools></tools> XML tags:\n<tools>")
_TOOLS_TAIL = ("\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
               "<tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": "
               "<args-json-object>}\n</tool_call>")


def _json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)  # transformers' tojson, as Qwen's template renders it


def tools_system_block(tools: Sequence[Mapping]) -> str:
    return _TOOLS_HEAD + "".join("\n" + _json(dict(t)) for t in tools) + _TOOLS_TAIL


def render_tool_calls(calls: Sequence[Mapping]) -> str:
    """An assistant's OpenAI ``tool_calls`` as Hermes calls (no leading newline)."""
    out = []
    for call in calls:
        args = (call.get("function") or {}).get("arguments")
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except ValueError:
                pass  # not JSON: written as the string it is
        body = f'{{"name": {_json(tool_name_of_call(call))}, "arguments": {_json(args)}}}'
        out.append(f"{CALL_OPEN}\n{body}\n{CALL_CLOSE}")
    return "\n".join(out)


def render_tool_results(contents: Sequence[str]) -> str:
    return "\n".join(f"<tool_response>\n{c}\n</tool_response>" for c in contents)


def forced_prefix(tools, tool_choice) -> str:
    """What the assistant's message is prefilled with to force a call without constrained decoding: "required" opens
    a call and its name (``<tool_call>\\n{"name": "``), a named function writes the name too (up to
    ``"arguments": ``); the model writes the rest."""
    if not tools or tool_choice in (None, "auto", "none"):
        return ""
    if tool_choice == "required":
        return CALL_OPEN + '\n{"name": "'
    return CALL_OPEN + f'\n{{"name": {_json(tool_choice["function"]["name"])}, "arguments": '


def parse_tool_call(body: str, tools: Mapping[str, Any]) -> dict:
    """A call's body -> {"name", "arguments"}; ValueError saying what is malformed."""
    try:
        obj = json.loads(body)
    except ValueError:
        raise ValueError(f"the tool call is not JSON: {body.strip()[:60]!r}") from None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        raise ValueError('a tool call must be a JSON object {"name": ..., "arguments": {...}}')
    name, args = obj["name"], obj.get("arguments", {})
    if tools and name not in tools:
        raise ValueError(f"the model called {name!r}, which is not among the declared tools {sorted(tools)}")
    if isinstance(args, str):  # some models write the arguments as a JSON string, as OpenAI sends them
        try:
            args = json.loads(args)
        except ValueError:
            raise ValueError(f"the arguments of {name!r} are not JSON: {args[:40]!r}") from None
    if not isinstance(args, dict):
        raise ValueError(f"the arguments of {name!r} must be a JSON object")
    return {"name": name, "arguments": args}


@dataclass
class HermesOutput:
    """``feed`` the reply's text as it is generated, ``finish`` at the end; both return ``OutputEvent``s: content,
    each parsed call, or a malformed call as its raw text with the reason. Text that could still grow into
    ``<tool_call>`` is held back until it cannot; whitespace between and after calls (the newlines that join them)
    is not content."""

    tools: dict[str, dict] = field(default_factory=dict)
    in_call: bool = False
    called: bool = False  # a call was seen: whitespace alone is no longer content
    buf: str = ""
    _call: str = ""
    _space: str = ""  # whitespace after a call, held until content follows it

    def feed(self, text: str) -> list[OutputEvent]:
        self.buf += text
        out: list[OutputEvent] = []
        while True:
            before, marker, self.buf = next_marker(self.buf, (CALL_CLOSE,) if self.in_call else (CALL_OPEN,))
            if self.in_call:
                self._call += before
            else:
                out += self._content(before)
            if marker is None:
                return out
            if self.in_call:
                out.append(self._parsed(self._call))
                self.in_call, self.called = False, True
            else:
                self.in_call, self._call, self._space = True, "", ""

    def _parsed(self, body: str) -> OutputEvent:
        raw = CALL_OPEN + body + CALL_CLOSE
        if not self.tools:
            return OutputEvent("error", raw, "the model wrote a tool call but no tools were declared")
        try:
            call = parse_tool_call(body, self.tools)
        except ValueError as e:
            return OutputEvent("error", raw, f"malformed tool call: {e}")
        return OutputEvent("tool_call", _json(call["arguments"]), call["name"], f"call_{uuid.uuid4().hex[:24]}")

    def finish(self) -> list[OutputEvent]:
        rest, self.buf = self.buf, ""
        if self.in_call:
            self.in_call = False
            return [OutputEvent("error", CALL_OPEN + self._call + rest,
                                "the tool call was not closed (the output ended first: max_tokens?)")]
        return self._content(rest)

    def _content(self, text: str) -> list[OutputEvent]:
        if self.called:
            self._space += text
            if not self._space.strip():
                return []
            text, self._space, self.called = self._space, "", False
        return [OutputEvent("content", text)] if text else []
