"""Chat formats: chat messages -> prompt token ids, and the assistant's text -> its message (content, reasoning,
tool calls). Below both k3.post (what fine-tuning teaches) and k3.serve / k3 chat (what is sent), so both use one
format; it imports nothing of k3 but the tokenizer it is handed.

Three chat formats, chosen by ``chat_template_for(tokenizer)``:
- ``KimiK3Chat`` (xtml.py, its reply parser xtml_reply.py), when the tokenizer has K3's XTML special tokens
  (``<|open|>`` ...): K3's format, with OpenAI ``tools`` / ``tool_calls`` / ``role: "tool"`` messages.
- ``JinjaChatTemplate`` (jinja.py), when the tokenizer brings a chat template (``tokenizer_config.json``'s
  ``chat_template``), with Kimi K2's tool calls (k2_tools.py) when the tokenizer has their tokens.
- ``ChatTemplate`` (chatml.py): ChatML, for k3's own byte-level tokenizer.

Every format gives ``prompt(tokenizer, messages, tools, tool_choice, reasoning_effort) -> ChatPrompt``: the ids
and a parser that turns the streamed completion text into ``OutputEvent``s (base.py); ChatML and K3's format also
give ``completion_ids(tokenizer, message, thinking)``: the tokens the model writes for an assistant message after
the prompt (the targets of fine-tuning, k3.post).
"""

from __future__ import annotations

from .base import ChatError, ChatPrompt, OutputEvent, PlainOutput
from .chatml import DEFAULT_GENERATION_PROMPT, DEFAULT_MESSAGE_FORMAT, DEFAULT_STOP, ChatTemplate
from .jinja import JinjaChatTemplate
from .k2_tools import K2_TOOL_TOKENS
from .xtml import KimiK3Chat
from .xtml_tags import SPECIAL_TOKENS

__all__ = ["ChatTemplate", "JinjaChatTemplate", "KimiK3Chat", "ChatPrompt", "ChatError", "OutputEvent",
           "PlainOutput", "chat_template_for", "DEFAULT_MESSAGE_FORMAT", "DEFAULT_GENERATION_PROMPT", "DEFAULT_STOP"]


def chat_template_for(tokenizer):
    """The chat format the tokenizer's model was trained with: K3's when its special tokens are there, else the
    tokenizer's own Jinja chat template, else ChatML."""
    specials = getattr(tokenizer, "special_tokens", None) or {}
    if all(t in specials for t in SPECIAL_TOKENS):
        return KimiK3Chat()
    source = getattr(tokenizer, "chat_template", None)
    if source:
        # the turn ends at the eos token or, in Kimi's templates, at <|im_end|>
        stop = tuple(dict.fromkeys(t for t in (getattr(tokenizer, "eos_token", None), "<|im_end|>") if t in specials))
        k2 = all(t in specials for t in K2_TOOL_TOKENS)
        return JinjaChatTemplate(source, stop, getattr(tokenizer, "bos_token", None),
                                 getattr(tokenizer, "eos_token", None), "kimi_k2" if k2 else None)
    return ChatTemplate()
