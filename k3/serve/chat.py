"""Chat messages -> one prompt string, and the stop string that ends an assistant turn.

The default template is ChatML. Each message renders as

    <|im_start|>{role}\\n{content}<|im_end|>\\n

in order, and the prompt ends with the generation prompt

    <|im_start|>assistant\\n

so the model writes the assistant's turn; generation stops at ``<|im_end|>`` (added to the request's stop
strings; the stop string itself is never returned). k3's byte-level tokenizer encodes the markers as ordinary
text, so a model fine-tuned on ChatML-formatted text follows it. Content is inserted verbatim: a message that
contains the markers itself can forge turns, exactly as it could in the training text.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

__all__ = ["ChatTemplate", "DEFAULT_MESSAGE_FORMAT", "DEFAULT_GENERATION_PROMPT", "DEFAULT_STOP"]

DEFAULT_MESSAGE_FORMAT = "<|im_start|>{role}\n{content}<|im_end|>\n"
DEFAULT_GENERATION_PROMPT = "<|im_start|>assistant\n"
DEFAULT_STOP = ("<|im_end|>",)


@dataclass(frozen=True)
class ChatTemplate:
    """``message_format`` is a ``str.format`` string with the fields ``{role}`` and ``{content}``."""

    message_format: str = DEFAULT_MESSAGE_FORMAT
    generation_prompt: str = DEFAULT_GENERATION_PROMPT
    stop: tuple[str, ...] = DEFAULT_STOP

    def __post_init__(self):
        try:
            self.message_format.format(role="user", content="x")
        except (KeyError, IndexError, ValueError) as e:
            raise ValueError(f"message_format may use only the fields {{role}} and {{content}} (write {{{{ and "
                             f"}}}} for literal braces); got {self.message_format!r}: {e}") from None

    def render(self, messages: Sequence[Mapping[str, str]]) -> str:
        """The prompt for ``messages`` ([{"role": ..., "content": ...}, ...], content as plain text)."""
        if not messages:
            raise ValueError("messages is empty; send at least one message")
        parts = [self.message_format.format(role=m["role"], content=m["content"]) for m in messages]
        return "".join(parts) + self.generation_prompt
