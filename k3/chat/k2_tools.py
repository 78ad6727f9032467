"""Kimi K2's tool calls in a reply, streamed apart from its content (the format of K2 / K2.5's Jinja chat template,
as their tool-call guidance, vLLM's and SGLang's ``kimi_k2`` parsers read it):

    Let me check.<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>
    {"city": "Paris"}<|tool_call_end|><|tool_call_begin|>functions.get_time:1<|tool_call_argument_begin|>{}
    <|tool_call_end|><|tool_calls_section_end|>

A call's id is ``functions.NAME:INDEX`` (the template writes it back beside the tool's result, so it is the
OpenAI ``tool_call_id`` too); its arguments are one JSON object. The section markers also come in the singular
(``<|tool_call_section_begin|>``), as the model sometimes writes them. A section that cannot be read (not closed,
a call without arguments, arguments that are not a JSON object, an undeclared tool) becomes an "error" event with
the raw text and what was wrong, as K3's format does (k3/chat/xtml_reply.py).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

from .base import OutputEvent, next_marker

__all__ = ["K2_TOOL_TOKENS", "K2Output", "parse_k2_section"]

SECTION_BEGIN = ("<|tool_calls_section_begin|>", "<|tool_call_section_begin|>")
SECTION_END = ("<|tool_calls_section_end|>", "<|tool_call_section_end|>")
CALL_BEGIN, ARG_BEGIN, CALL_END = "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"
K2_TOOL_TOKENS = (SECTION_BEGIN[0], SECTION_END[0], CALL_BEGIN, ARG_BEGIN, CALL_END)  # a K2 tokenizer has them all
_CALL = re.compile(re.escape(CALL_BEGIN) + r"\s*(?P<id>.*?)\s*" + re.escape(ARG_BEGIN) + r"(?P<args>.*?)"
                   + re.escape(CALL_END), re.DOTALL)


def _name_of(call_id: str) -> str:
    """``functions.get_weather:0`` -> ``get_weather``."""
    name = call_id.rsplit(":", 1)[0] if ":" in call_id else call_id
    return name.split(".", 1)[1] if name.startswith("functions.") else name


def parse_k2_section(section: str, tools: dict[str, dict]) -> list[dict]:
    """The calls between a section's markers -> [{"id", "name", "arguments"}]; ValueError saying what is wrong."""
    rest = _CALL.sub("", section).strip()
    if rest:
        raise ValueError(f"text outside a call in the tool-calls section: {rest[:40]!r}")
    calls = []
    for m in _CALL.finditer(section):
        call_id = m.group("id")
        name = _name_of(call_id)
        if not name:
            raise ValueError(f"a call's id {call_id!r} names no function")
        if tools and name not in tools:
            raise ValueError(f"the model called {name!r}, which is not among the declared tools {sorted(tools)}")
        try:
            args = json.loads(m.group("args"))
        except ValueError:
            raise ValueError(f"the arguments of {name!r} are not JSON: {m.group('args')[:40]!r}") from None
        if not isinstance(args, dict):
            raise ValueError(f"the arguments of {name!r} must be a JSON object")
        calls.append({"id": call_id, "name": name, "arguments": args})
    if not calls:
        raise ValueError("the tool-calls section holds no complete call")
    return calls


@dataclass
class K2Output:
    """``feed`` the reply's text as it is generated, ``finish`` at the end; both return ``OutputEvent``s: content,
    each parsed tool call, or a malformed section as text with the reason."""

    tools: dict[str, dict] = field(default_factory=dict)
    in_section: bool = False
    buf: str = ""
    _section: str = ""
    _opened_with: str = ""

    def feed(self, text: str) -> list[OutputEvent]:
        self.buf += text
        out: list[OutputEvent] = []
        while True:
            before, marker, self.buf = next_marker(self.buf, SECTION_END if self.in_section else SECTION_BEGIN)
            out += self._emit(before)
            if marker is None:
                return out
            if self.in_section:
                out += self._calls(self._section, self._opened_with + self._section + marker)
                self.in_section = False
            else:
                self.in_section, self._section, self._opened_with = True, "", marker

    def _emit(self, text: str) -> list[OutputEvent]:
        if not text:
            return []
        if self.in_section:
            self._section += text
            return []
        return [OutputEvent("content", text)]

    def _calls(self, section: str, raw: str) -> list[OutputEvent]:
        if not self.tools:
            return [OutputEvent("error", raw, "the model wrote a tool-calls section but no tools were declared")]
        try:
            calls = parse_k2_section(section, self.tools)
        except ValueError as e:
            return [OutputEvent("error", raw, f"malformed tool call: {e}")]
        return [OutputEvent("tool_call", json.dumps(c["arguments"], ensure_ascii=False), c["name"], c["id"])
                for c in calls]

    def finish(self) -> list[OutputEvent]:
        rest, self.buf = self.buf, ""
        if self.in_section:
            self.in_section = False
            return [OutputEvent("error", self._opened_with + self._section + rest,
                                "the tool-calls section was not closed (the output ended first: max_tokens?)")]
        return self._emit(rest)
