"""The assistant's reply in K3's chat format, streamed apart into content, reasoning and tool calls (the format
is described in k3/chat/xtml.py; the tools section is read as mlx-lm's ``tool_parsers/kimi_k3.py`` reads it).

A tools section that cannot be read (not closed, a call without a tool, an argument that is not the JSON its type
says, a tool that was not declared) becomes an "error" event carrying the raw text and what was wrong: the server
returns it as content with ``tool_call_error``.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from .base import OutputEvent, next_marker
from .xtml_tags import close_tag, open_tag

__all__ = ["K3Output", "parse_tools_section"]


def _unescape_attr(value: str) -> str:
    return value.replace("&quot;", '"').replace("&amp;", "&")


_CALL = re.compile(r"<\|open\|>call(?P<attrs>(?:(?!<\|sep\|>).)*)<\|sep\|>(?P<body>.*?)<\|close\|>call<\|sep\|>",
                   re.DOTALL)
_ARG = re.compile(r"<\|open\|>argument(?P<attrs>(?:(?!<\|sep\|>).)*)<\|sep\|>(?P<value>.*?)<\|close\|>argument<\|sep\|>",
                  re.DOTALL)
_JSON = re.compile(r"<\|open\|>json(?:(?!<\|sep\|>).)*<\|sep\|>(?P<value>.*?)<\|close\|>json<\|sep\|>", re.DOTALL)
_ATTR = re.compile(r'(\w+)="([^"]*)"')
_THINK_CLOSE, _RESPONSE_OPEN, _RESPONSE_CLOSE = close_tag("think"), open_tag("response"), close_tag("response")
_TOOLS_OPEN, _TOOLS_CLOSE, _MESSAGE_CLOSE = open_tag("tools"), close_tag("tools"), close_tag("message")


def _value(raw: str, kind: str) -> Any:
    if kind == "string":
        return raw
    try:
        return json.loads(raw)
    except ValueError:
        raise ValueError(f"argument of type {kind!r} is not JSON: {raw[:40]!r}") from None


def parse_tools_section(section: str, tools: dict[str, dict]) -> list[dict]:
    """The calls in a tools section -> [{"name", "arguments"}]; ValueError saying what is malformed."""
    calls, rest = [], _CALL.sub("", section[len(_TOOLS_OPEN):-len(_TOOLS_CLOSE)]).strip()
    if rest:
        raise ValueError(f"text outside a call in the tools section: {rest[:40]!r}")
    for m in _CALL.finditer(section):
        attrs = {k: _unescape_attr(v) for k, v in _ATTR.findall(m.group("attrs"))}
        name, body = attrs.get("tool"), m.group("body")
        if not name:
            raise ValueError("a call has no tool attribute")
        if tools and name not in tools:
            raise ValueError(f"the model called {name!r}, which is not among the declared tools {sorted(tools)}")
        j = _JSON.search(body)
        if j is not None:
            try:
                args = json.loads(j.group("value"))
            except ValueError:
                raise ValueError(f"the json block of {name!r} is not JSON: {j.group('value')[:40]!r}") from None
            if not isinstance(args, dict):
                raise ValueError("the json block of a call must hold an object")
        else:
            args = {}
            for a in _ARG.finditer(body):
                at = {k: _unescape_attr(v) for k, v in _ATTR.findall(a.group("attrs"))}
                if "key" not in at:
                    raise ValueError("an argument has no key attribute")
                args[at["key"]] = _value(a.group("value"), at.get("type", "string"))
        calls.append({"name": name, "arguments": args})
    if not calls:
        raise ValueError("the tools section holds no complete call")
    return calls


@dataclass
class K3Output:
    """Streams one assistant message in K3's format apart: ``feed`` text as it is generated, ``finish`` at the end;
    both return ``OutputEvent``s (content, reasoning, a parsed tool call, or a malformed tools section as text)."""

    tools: dict[str, dict] = field(default_factory=dict)
    thinking: bool = False
    state: str = ""
    buf: str = ""
    _section: str = ""

    def __post_init__(self):
        self.state = self.state or ("think" if self.thinking else "response")

    def _markers(self) -> tuple[str, ...]:
        return {"think": (_THINK_CLOSE,), "open_response": (_RESPONSE_OPEN,),
                "response": (_RESPONSE_CLOSE, _TOOLS_OPEN, _MESSAGE_CLOSE),
                "after": (_TOOLS_OPEN, _MESSAGE_CLOSE), "tools": (_TOOLS_CLOSE,), "done": ()}[self.state]

    def feed(self, text: str) -> list[OutputEvent]:
        self.buf += text
        out: list[OutputEvent] = []
        while True:
            before, marker, self.buf = next_marker(self.buf, self._markers())
            out += self._emit(before)
            if marker is None:
                return out
            out += self._transition(marker)

    def _emit(self, text: str) -> list[OutputEvent]:
        if not text:
            return []
        if self.state == "tools":
            self._section += text
            return []
        if self.state == "think":
            return [OutputEvent("reasoning", text)]
        if self.state in ("open_response", "after") and not text.strip():
            return []
        if self.state == "done":
            return []
        return [OutputEvent("content", text)]

    def _transition(self, marker: str) -> list[OutputEvent]:
        if marker == _THINK_CLOSE:
            self.state = "open_response"
        elif marker == _RESPONSE_OPEN:
            self.state = "response"
        elif marker == _RESPONSE_CLOSE:
            self.state = "after"
        elif marker == _TOOLS_OPEN:
            self.state, self._section = "tools", ""
        elif marker == _MESSAGE_CLOSE:
            self.state = "done"
        elif marker == _TOOLS_CLOSE:
            self.state = "after"
            return self._calls(_TOOLS_OPEN + self._section + _TOOLS_CLOSE)
        return []

    def _calls(self, section: str) -> list[OutputEvent]:
        if not self.tools:
            return [OutputEvent("error", section, "the model wrote a tools section but no tools were declared")]
        try:
            calls = parse_tools_section(section, self.tools)
        except ValueError as e:  # json.JSONDecodeError included
            return [OutputEvent("error", section, f"malformed tool call: {e}")]
        return [OutputEvent("tool_call", json.dumps(c["arguments"], ensure_ascii=False), c["name"],
                            f"call_{uuid.uuid4().hex[:24]}") for c in calls]

    def finish(self) -> list[OutputEvent]:
        rest, self.buf = self.buf, ""
        if self.state == "tools":
            self.state = "done"
            return [OutputEvent("error", _TOOLS_OPEN + self._section + rest,
                                "the tools section was not closed (the output ended first: max_tokens?)")]
        out = self._emit(rest)
        self.state = "done"
        return out
