"""ChatML, the chat format of k3's own byte-level tokenizer (what ``k3 train`` / ``k3 sft`` models use). Each
message renders as

    <|im_start|>{role}\\n{content}<|im_end|>\\n

and the prompt ends with the generation prompt ``<|im_start|>assistant\\n``; generation stops at ``<|im_end|>``
(added to the request's stop strings; never returned). k3's byte-level tokenizer encodes the markers as ordinary
text, so a model fine-tuned on ChatML-formatted text follows it, and content can forge turns exactly as it could
in the training text. No tool calls.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .base import ChatError, ChatPrompt, PlainOutput, encode, refuse_tools_and_effort

__all__ = ["ChatTemplate", "DEFAULT_MESSAGE_FORMAT", "DEFAULT_GENERATION_PROMPT", "DEFAULT_STOP"]

DEFAULT_MESSAGE_FORMAT = "<|im_start|>{role}\n{content}<|im_end|>\n"
DEFAULT_GENERATION_PROMPT = "<|im_start|>assistant\n"
DEFAULT_STOP = ("<|im_end|>",)


@dataclass(frozen=True)
class ChatTemplate:
    """ChatML (the default): ``message_format`` is a ``str.format`` string with the fields ``{role}`` and
    ``{content}``."""

    message_format: str = DEFAULT_MESSAGE_FORMAT
    generation_prompt: str = DEFAULT_GENERATION_PROMPT
    stop: tuple[str, ...] = DEFAULT_STOP
    supports_tools = False
    supports_thinking = False

    def __post_init__(self):
        try:
            self.message_format.format(role="user", content="x")
        except (KeyError, IndexError, ValueError) as e:
            raise ValueError(f"message_format may use only the fields {{role}} and {{content}} (write {{{{ and "
                             f"}}}} for literal braces); got {self.message_format!r}: {e}") from None

    def render(self, messages: Sequence[Mapping[str, Any]], tools=None, tool_choice=None,
               reasoning_effort=None) -> str:
        """The prompt for ``messages`` ([{"role": ..., "content": ...}, ...], content as plain text)."""
        if not messages:
            raise ChatError("messages is empty; send at least one message")
        refuse_tools_and_effort("ChatML", tools, tool_choice, reasoning_effort)
        parts = [self.message_format.format(role=m["role"], content=m.get("content") or "") for m in messages]
        return "".join(parts) + self.generation_prompt

    def prompt(self, tokenizer, messages, tools=None, tool_choice=None, reasoning_effort=None) -> ChatPrompt:
        return ChatPrompt(encode(tokenizer, self.render(messages, tools, tool_choice, reasoning_effort)),
                          PlainOutput())

    def completion_ids(self, tokenizer, message: Mapping[str, Any], thinking: bool = False) -> list[int]:
        """The tokens the model writes for the assistant ``message`` after ``prompt``: its content and the first
        stop string (what ends generation). ``thinking`` is refused: the format has no thinking channel."""
        refuse_tools_and_effort("ChatML", None, None, "thinking" if thinking else None)
        return encode(tokenizer, (message.get("content") or "") + self.stop[0])
