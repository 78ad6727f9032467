"""OpenAI response bodies and stream chunks, built from the engine's TokenEvents and FinishEvent.

Completions: ``object: "text_completion"``, ``choices[0].text``, legacy logprobs
``{tokens, token_logprobs, top_logprobs: [{token: logprob}], text_offset}``.
Chat: ``object: "chat.completion"`` / ``"chat.completion.chunk"``, ``choices[0].message`` / ``delta``, logprobs
``{content: [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}], refusal: null}``.
Both: ``usage = {prompt_tokens, completion_tokens, total_tokens, prompt_tokens_details: {cached_tokens}}``.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import ClassVar

from tokenizers import Tokenizer

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

    def chunk(self, text: str, events: Sequence[TokenEvent], finish_reason: str | None = None) -> dict:
        return self._chunk_body(self._choice(text, events, finish_reason))


@dataclass
class ChatFormat(Formatter):
    PREFIX: ClassVar[str] = "chatcmpl"
    CHUNK: ClassVar[str] = "chat.completion.chunk"

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

    def response(self, events: Sequence[TokenEvent], f: FinishEvent) -> dict:
        message = {"role": "assistant", "content": f.text, "refusal": None}
        choice = {"index": 0, "message": message, "logprobs": self._logprobs(events), "finish_reason": f.reason}
        return self._body("chat.completion", [choice], usage=usage(f))

    def first_chunk(self) -> dict | None:
        return self._chunk_body({"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                 "finish_reason": None})

    def chunk(self, text: str, events: Sequence[TokenEvent], finish_reason: str | None = None) -> dict:
        return self._chunk_body({"index": 0, "delta": {"content": text} if text else {},
                                 "logprobs": self._logprobs(events), "finish_reason": finish_reason})
