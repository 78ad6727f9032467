"""Kimi K3's chat format ("XTML") and its tool calls: prompts in, assistant messages (content, reasoning, tool
calls) out, streaming.

Every span is ``<|open|>NAME attrs<|sep|> ... <|close|>NAME<|sep|>``; a message ends with ``<|end_of_msg|>``:

    <|open|>message role="system" type="tool-declare"<|sep|># Tools ... ```json [tools] ```<|close|>message<|sep|><|end_of_msg|>
    <|open|>message role="user"<|sep|>What is the weather in Paris?<|close|>message<|sep|><|end_of_msg|>
    <|open|>message role="assistant"<|sep|><|open|>response<|sep|>Let me look.<|close|>response<|sep|>
      <|open|>tools<|sep|><|open|>call tool="get_weather" index="1"<|sep|>
        <|open|>argument key="city" type="string"<|sep|>Paris<|close|>argument<|sep|>
      <|close|>call<|sep|><|close|>tools<|sep|><|close|>message<|sep|><|end_of_msg|>
    <|open|>message role="tool" name="get_weather"<|sep|>{"temp": 21}<|close|>message<|sep|><|end_of_msg|>
    <|open|>message role="assistant"<|sep|><|open|>response<|sep|>          <- the generation prompt

Arguments are typed per key (``type`` string/number/boolean/null/object/array; strings raw, the rest JSON) or one
raw JSON object block ``<|open|>json type="object"<|sep|>{...}<|close|>json<|sep|>``; attribute values escape
``&`` and ``"`` as ``&amp;`` / ``&quot;``. This is the format mlx-lm's ``tool_parsers/kimi_k3.py`` reads and the
public renderers of the release's ``encoding_k3.py`` write; the release ships Python, not a Jinja template. With
thinking (``reasoning_effort``) a ``thinking-effort`` system block precedes the conversation and the generation
prompt opens ``<|open|>think<|sep|>`` instead; earlier assistant turns are rendered without their reasoning.

Structure and content are encoded apart: markup with the special tokens, message content as plain text
(``KimiTokenizer.encode_text``), so a user who types ``<|open|>`` cannot forge a turn.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from .base import ChatError, ChatPrompt, check_tool_choice, tool_name_of_call, tools_by_name
from .xtml_reply import K3Output
from .xtml_tags import END_OF_MSG, OPEN, close_tag, open_tag

__all__ = ["KimiK3Chat", "render_tool_calls"]

EFFORTS = ("low", "high", "max")
_TOOL_DECLARE = "# Tools\nHere are the available tools, described in JSONSchema.\n\n```json\n{tools}\n```"
_EFFORT = ("`thinking_effort` guides on how much to think in your thinking channel (not including the response "
           "channel), supported values include `low`, `medium`, `high`, and `max`.\n"
           "Now the system is invoked with `thinking_effort={effort}`.")


def _xtml_type(v: Any) -> str:
    if isinstance(v, bool):
        return "boolean"
    if v is None:
        return "null"
    if isinstance(v, (int, float)):
        return "number"
    return {str: "string", dict: "object"}.get(type(v), "array")


def render_tool_calls(calls: list[dict]) -> list[tuple[str, bool]]:
    """An assistant's OpenAI ``tool_calls`` as the tools section: [(text, is_markup)]."""
    out = [(open_tag("tools"), True)]
    for i, call in enumerate(calls, 1):
        fn = call.get("function", call)
        out.append((open_tag("call", tool=fn.get("name", ""), index=i), True))
        args = fn.get("arguments")
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except ValueError:
                pass  # not JSON: carried verbatim in a json block
        if isinstance(args, dict):
            for key, v in args.items():
                out += [(open_tag("argument", key=key, type=_xtml_type(v)), True),
                        (v if isinstance(v, str) else json.dumps(v, ensure_ascii=False), False),
                        (close_tag("argument"), True)]
        elif args is not None:
            raw = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
            out += [(open_tag("json", type="object"), True), (raw, False), (close_tag("json"), True)]
        out.append((close_tag("call"), True))
    return out + [(close_tag("tools"), True)]


def _deep_sort(obj):
    if isinstance(obj, dict):
        return {k: _deep_sort(obj[k]) for k in sorted(obj)}
    if isinstance(obj, list):
        return [_deep_sort(x) for x in obj]
    return obj


@dataclass(frozen=True)
class KimiK3Chat:
    """K3's chat format. ``stop``: the end of the assistant's message."""

    stop: tuple[str, ...] = (END_OF_MSG,)
    supports_tools: bool = True
    supports_thinking: bool = True

    def segments(self, messages: list[dict], tools: list[dict] | None = None, tool_choice: Any = None,
                 reasoning_effort: str | None = None) -> tuple[list[tuple[str, bool]], str]:
        """The prompt as [(text, is_markup)] and the assistant text it already contains (the forced-call prefix)."""
        if not messages:
            raise ChatError("messages is empty; send at least one message")
        if reasoning_effort is not None and reasoning_effort not in EFFORTS:
            raise ChatError(f"reasoning_effort must be one of {list(EFFORTS)} for this model; got {reasoning_effort!r}",
                            "reasoning_effort")
        declared = tools if tools and tool_choice != "none" else None
        seg: list[tuple[str, bool]] = []

        def system(kind: str, body: str):
            seg.extend([(open_tag("message", role="system", type=kind), True), (body.strip(), False),
                        (close_tag("message") + END_OF_MSG, True)])

        if declared:
            compact = json.dumps(_deep_sort(declared), separators=(",", ":"), ensure_ascii=False)
            system("tool-declare", _TOOL_DECLARE.format(tools=compact))
        if reasoning_effort is not None:
            system("thinking-effort", _EFFORT.format(effort=reasoning_effort))
        names = {}  # tool_call_id -> function name, from the assistant turns so far
        for m in messages:
            role = {"developer": "system"}.get(m["role"], m["role"])
            if role == "tool":
                name = names.get(m.get("tool_call_id")) or m.get("name")
                if not name:
                    raise ChatError(f"a tool message's tool_call_id {m.get('tool_call_id')!r} matches no tool_calls id "
                                     "of an earlier assistant message; send the assistant message with its tool_calls")
                seg.append((open_tag("message", role="tool", name=name), True))
            else:
                seg.append((open_tag("message", role=role), True))
            if role == "assistant":
                if m.get("reasoning_content"):
                    seg += [(open_tag("think"), True), (m["reasoning_content"], False), (close_tag("think"), True)]
                seg += [(open_tag("response"), True), (m.get("content") or "", False), (close_tag("response"), True)]
                if m.get("tool_calls"):
                    for c in m["tool_calls"]:
                        names[c.get("id")] = tool_name_of_call(c)
                    seg += render_tool_calls(m["tool_calls"])
            else:
                seg.append((m.get("content") or "", False))
            seg.append((close_tag("message") + END_OF_MSG, True))
        channel = "think" if reasoning_effort is not None else "response"
        seg.append((open_tag("message", role="assistant") + open_tag(channel), True))
        prefix = self._forced_prefix(declared, tool_choice, reasoning_effort)
        if prefix:
            seg.append((prefix, True))
        return seg, prefix

    @staticmethod
    def _forced_prefix(tools, tool_choice, reasoning_effort) -> str:
        """tool_choice "required" or a named function: the assistant's message starts inside a call (the model
        only writes the name and arguments), which forces the call without constrained decoding."""
        if not tools or tool_choice in (None, "auto", "none"):
            return ""
        head = (close_tag("think") + open_tag("response") if reasoning_effort is not None else "") + \
            close_tag("response") + open_tag("tools")
        if tool_choice == "required":
            return head + OPEN + 'call tool="'
        return head + open_tag("call", tool=tool_choice["function"]["name"], index=1)

    def render(self, messages: list[dict], tools: list[dict] | None = None, tool_choice: Any = None,
               reasoning_effort: str | None = None) -> str:
        return "".join(t for t, _ in self.segments(messages, tools, tool_choice, reasoning_effort)[0])

    def prompt(self, tokenizer, messages: list[dict], tools: list[dict] | None = None, tool_choice: Any = None,
               reasoning_effort: str | None = None) -> ChatPrompt:
        check_tool_choice(tools, tool_choice)
        seg, prefix = self.segments(messages, tools, tool_choice, reasoning_effort)
        ids = _encode_segments(tokenizer, seg)
        parser = K3Output(tools_by_name(tools) if tools and tool_choice != "none" else {},
                          thinking=reasoning_effort is not None)
        parser.feed(prefix)  # the forced prefix is part of the assistant's message: nothing to emit yet
        return ChatPrompt(ids, parser)

    def completion_ids(self, tokenizer, message: dict, thinking: bool = False) -> list[int]:
        """The tokens the model writes for the assistant ``message`` after ``prompt``'s generation prompt, to the
        end of the message: with ``thinking`` (the prompt had a ``reasoning_effort``) its ``reasoning_content`` in
        the open think channel first, then the response and its tool calls."""
        seg: list[tuple[str, bool]] = []
        if thinking:
            seg += [(message.get("reasoning_content") or "", False), (close_tag("think") + open_tag("response"), True)]
        seg += [(message.get("content") or "", False), (close_tag("response"), True)]
        if message.get("tool_calls"):
            seg += render_tool_calls(message["tool_calls"])
        seg.append((close_tag("message") + END_OF_MSG, True))
        return _encode_segments(tokenizer, seg)


def _encode_segments(tokenizer, seg: list[tuple[str, bool]]) -> list[int]:
    """Markup with the special tokens, content as plain text (``encode_text``: it cannot forge structure)."""
    as_text = getattr(tokenizer, "encode_text", None)
    ids: list[int] = []
    for text, markup in seg:
        if text:
            ids += tokenizer.encode(text, add_special_tokens=False).ids if markup or as_text is None else as_text(text)
    return ids
