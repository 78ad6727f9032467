"""OpenAI response bodies and stream chunks, built from the engine's TokenEvents and FinishEvent.

Completions: ``object: "text_completion"``, ``choices[0].text``, legacy logprobs
``{tokens, token_logprobs, top_logprobs: [{token: logprob}], text_offset}``.
Chat: ``object: "chat.completion"`` / ``"chat.completion.chunk"``, ``choices[0].message`` / ``delta``, logprobs
``{content: [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}], refusal: null}``; the chat format's
parser splits the text into ``content``, ``reasoning_content`` and ``tool_calls`` (``[{id, type: "function",
function: {name, arguments}}]``, finish_reason ``"tool_calls"``; streamed as ``delta.tool_calls[{index, ...}]``).
Malformed tool output comes back as content with ``tool_call_error`` saying what was wrong (a k3 extension).
Both: ``usage = {prompt_tokens, completion_tokens, total_tokens, prompt_tokens_details: {cached_tokens}}``.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from tokenizers import Tokenizer

from ..chat import OutputEvent, PlainOutput
from ..inference.api import FinishEvent, TokenEvent
from ..inference.detok import token_bytes

__all__ = ["Formatter", "CompletionFormat", "ChatFormat", "usage", "sse", "DONE"]

DONE = "data: [DONE]\n\n"


def sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def usage(f: FinishEvent) -> dict:
    return {"prompt_tokens": f.prompt_tokens, "completion_tokens": f.completion_tokens,
            "total_tokens": f.prompt_tokens + f.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": f.cached_tokens}}


@dataclass
class Formatter:
    """What one request's bodies share: id, timestamp, model, and whether logprobs / usage chunks are wanted."""

    PREFIX: ClassVar[str] = ""
    CHUNK: ClassVar[str] = ""

    model: str
    tokenizer: Tokenizer
    logprobs: bool = False
    include_usage: bool = False
    id: str = ""
    created: int = field(default_factory=lambda: int(time.time()))

    def __post_init__(self):
        self.id = self.id or f"{self.PREFIX}-{uuid.uuid4().hex}"

    def _body(self, obj: str, choices: list, **extra) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "system_fingerprint": None, "choices": choices, **extra}

    def _chunk_body(self, choice: dict) -> dict:
        # with include_usage, OpenAI sends "usage": null on every chunk but the last one
        return self._body(self.CHUNK, [choice], **({"usage": None} if self.include_usage else {}))

    def usage_chunk(self, f: FinishEvent) -> dict:
        return self._body(self.CHUNK, [], usage=usage(f))

    def _text(self, token_id: int) -> tuple[str, bytes]:
        raw = token_bytes(self.tokenizer, token_id)
        return raw.decode("utf-8", errors="replace"), raw

    def first_chunk(self) -> dict | None:
        return None


@dataclass
class CompletionFormat(Formatter):
    PREFIX: ClassVar[str] = "cmpl"
    CHUNK: ClassVar[str] = "text_completion"
    _offset: int = 0  # text_offset: characters of token text reported so far

    def _logprobs(self, events: Sequence[TokenEvent]) -> dict | None:
        if not self.logprobs or not events:
            return None
        tokens = [self._text(e.token_id)[0] for e in events]
        offsets = []
        for t in tokens:
            offsets.append(self._offset)
            self._offset += len(t)
        return {"tokens": tokens, "token_logprobs": [e.logprob for e in events],
                "top_logprobs": [{self._text(i)[0]: lp for i, lp in e.top_logprobs} for e in events],
                "text_offset": offsets}

    def _choice(self, text: str, events: Sequence[TokenEvent], finish_reason: str | None) -> dict:
        return {"index": 0, "text": text, "logprobs": self._logprobs(events), "finish_reason": finish_reason}

    def response(self, events: Sequence[TokenEvent], f: FinishEvent) -> dict:
        return self._body("text_completion", [self._choice(f.text, events, f.reason)], usage=usage(f))

    def chunks(self, text: str, events: Sequence[TokenEvent], finish_reason: str | None = None) -> list[dict]:
        return [self._chunk_body(self._choice(text, events, finish_reason))]


@dataclass
class ChatFormat(Formatter):
    PREFIX: ClassVar[str] = "chatcmpl"
    CHUNK: ClassVar[str] = "chat.completion.chunk"
    parser: Any = field(default_factory=PlainOutput)  # the chat format's: text -> OutputEvents
    _calls: int = 0  # tool calls streamed so far (their delta index)

    def _logprobs(self, events: Sequence[TokenEvent]) -> dict | None:
        if not self.logprobs or not events:
            return None
        content = []
        for e in events:
            token, raw = self._text(e.token_id)
            top = [{"token": t, "logprob": lp, "bytes": list(raw_t)}
                   for (t, raw_t), lp in ((self._text(i), lp) for i, lp in e.top_logprobs)]
            content.append({"token": token, "logprob": e.logprob, "bytes": list(raw), "top_logprobs": top})
        return {"content": content, "refusal": None}

    @staticmethod
    def _call(ev: OutputEvent) -> dict:
        return {"id": ev.id, "type": "function", "function": {"name": ev.name, "arguments": ev.text}}

    def response(self, events: Sequence[TokenEvent], f: FinishEvent) -> dict:
        parsed = self.parser.feed(f.text) + self.parser.finish()
        text = {k: "".join(e.text for e in parsed if e.kind == k) for k in ("content", "reasoning", "error")}
        calls = [self._call(e) for e in parsed if e.kind == "tool_call"]
        message = {"role": "assistant", "content": (text["content"] + text["error"]) or (None if calls else ""),
                   "refusal": None}
        if calls:
            message["tool_calls"] = calls
        if text["reasoning"]:
            message["reasoning_content"] = text["reasoning"]
        errors = [e.name for e in parsed if e.kind == "error"]
        if errors:
            message["tool_call_error"] = "; ".join(errors)
        reason = "tool_calls" if calls and f.reason == "stop" else f.reason
        choice = {"index": 0, "message": message, "logprobs": self._logprobs(events), "finish_reason": reason}
        return self._body("chat.completion", [choice], usage=usage(f))

    def first_chunk(self) -> dict | None:
        return self._chunk_body({"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                 "finish_reason": None})

    def _delta(self, ev: OutputEvent) -> dict:
        if ev.kind == "tool_call":
            self._calls += 1
            return {"tool_calls": [{"index": self._calls - 1, **self._call(ev)}]}
        if ev.kind == "error":
            return {"content": ev.text, "tool_call_error": ev.name}
        return {"reasoning_content" if ev.kind == "reasoning" else "content": ev.text}

    def chunks(self, text: str, events: Sequence[TokenEvent], finish_reason: str | None = None) -> list[dict]:
        """The stream chunks for newly generated ``text`` (one per parsed piece; the token logprobs ride on the
        first, or on an empty delta when the parser holds the text back)."""
        parsed = self.parser.feed(text) if text else []
        if finish_reason is not None:
            parsed += self.parser.finish()
            if self._calls or any(e.kind == "tool_call" for e in parsed):
                finish_reason = "tool_calls" if finish_reason == "stop" else finish_reason
        deltas = [self._delta(e) for e in parsed]
        logprobs = self._logprobs(events)
        if not deltas and (logprobs is not None or finish_reason is not None):
            deltas = [{}]
        out = []
        for i, delta in enumerate(deltas):
            last = i == len(deltas) - 1
            out.append(self._chunk_body({"index": 0, "delta": delta, "logprobs": logprobs if i == 0 else None,
                                         "finish_reason": finish_reason if last else None}))
        return out
