"""Problems, reasoning efforts and replies in a checkpoint's chat format (SPEC §9).

``ChatFormat(tokenizer)`` wraps ``k3.chat.chat_template_for(tokenizer)``, the format the model is served in,
so what post-training teaches is what ``k3 chat`` and ``k3 serve`` send:
- the effort is part of the prompt: K3's format renders it as its ``thinking-effort`` system block
  (``reasoning_effort``); a format without one (ChatML, k3's own tokenizer) gets the system message
  "Reasoning effort: {effort}." first;
- reasoning is written in K3's think channel, or, without one, in the content as ``<think>\\n...\\n</think>\\n``
  before the answer; ``parse`` splits a reply back into (reasoning, answer);
- ``prompt_ids`` / ``completion_ids`` are the template's own (``prompt``, ``completion_ids``), and ``stop`` the strings
  that end generation.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..chat import chat_template_for
from ..chat.xtml_reply import K3Output

__all__ = ["ChatFormat", "EFFORT_SYSTEM", "THINK_OPEN", "THINK_CLOSE"]

EFFORT_SYSTEM = "Reasoning effort: {effort}."
THINK_OPEN, THINK_CLOSE = "<think>\n", "\n</think>\n"


class ChatFormat:
    def __init__(self, tokenizer, template=None):
        self.tokenizer = tokenizer
        self.template = template or chat_template_for(tokenizer)
        self.thinking_channel = self.template.supports_thinking  # K3's format has a think channel

    @property
    def stop(self) -> tuple[str, ...]:
        return tuple(self.template.stop)

    def messages(self, messages: Sequence[dict], effort: str | None) -> tuple[list[dict], str | None]:
        """(messages, reasoning_effort) to render: the effort as the template's own field or a system message."""
        if effort is None or self.thinking_channel:
            return list(messages), effort
        return [{"role": "system", "content": EFFORT_SYSTEM.format(effort=effort)}, *messages], None

    def prompt_ids(self, messages: Sequence[dict], effort: str | None = None) -> list[int]:
        msgs, reasoning_effort = self.messages(messages, effort)
        return self.template.prompt(self.tokenizer, msgs, reasoning_effort=reasoning_effort).ids

    def assistant(self, reasoning: str, answer: str) -> dict:
        """The assistant message of a reply (reasoning may be "")."""
        if self.thinking_channel:
            return {"role": "assistant", "content": answer, "reasoning_content": reasoning}
        return {"role": "assistant", "content": (THINK_OPEN + reasoning + THINK_CLOSE if reasoning else "") + answer}

    def completion_ids(self, message: dict, effort: str | None = None) -> list[int]:
        """The tokens of the assistant ``message`` after ``prompt_ids(..., effort)``."""
        message = dict(message)
        if not self.thinking_channel and message.get("reasoning_content"):  # a dataset's reasoning, in the content
            message = self.assistant(message.pop("reasoning_content"), message.get("content") or "")
        return self.template.completion_ids(self.tokenizer, message,
                                            thinking=effort is not None and self.thinking_channel)

    def parse(self, text: str, effort: str | None = None) -> tuple[str, str]:
        """A generated reply (the engine's text, stop string excluded) -> (reasoning, answer)."""
        if self.thinking_channel:
            parser = K3Output({}, thinking=effort is not None)
            events = parser.feed(text) + parser.finish()
            return ("".join(e.text for e in events if e.kind == "reasoning"),
                    "".join(e.text for e in events if e.kind == "content").strip())
        if THINK_CLOSE.strip() in text:
            reasoning, _, answer = text.rpartition(THINK_CLOSE.strip())
            return reasoning.replace(THINK_OPEN.strip(), "", 1).strip(), answer.strip()
        return "", text.strip()
