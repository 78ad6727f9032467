"""ChatML, the chat format of k3's own byte-level tokenizer (what ``k3 train`` / ``k3 sft`` models use). Each
message renders as

    <|im_start|>{role}\\n{content}<|im_end|>\\n

and the prompt ends with the generation prompt ``<|im_start|>assistant\\n``; generation stops at ``<|im_end|>``
(added to the request's stop strings; never returned). k3's byte-level tokenizer encodes the markers as ordinary
text, so a model fine-tuned on ChatML-formatted text follows it, and content can forge turns exactly as it could
in the training text. Tools (OpenAI ``tools``, assistant ``tool_calls``, ``role: "tool"`` messages) use the Hermes
convention of Qwen2.5's template (k3/chat/hermes.py); there is no thinking channel.

``tool_choice``: "none" (or no tools) renders no tools and parses no calls; "auto" declares them and parses what
the model writes; "required" and a named function prefill the assistant's turn with the start of a call
(``<tool_call>\\n{"name": "`` / up to ``"arguments": ``), so the model can only continue the call: this forces a call
without constrained decoding (the model may still write it malformed: then it comes back as content).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .base import ChatError, ChatPrompt, PlainOutput, check_tool_choice, encode, refuse_tools_and_effort, tools_by_name
from .hermes import HermesOutput, forced_prefix, render_tool_calls, render_tool_results, tools_system_block

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
    supports_tools = True
    supports_thinking = False

    def __post_init__(self):
        try:
            self.message_format.format(role="user", content="x")
        except (KeyError, IndexError, ValueError) as e:
            raise ValueError(f"message_format may use only the fields {{role}} and {{content}} (write {{{{ and "
                             f"}}}} for literal braces); got {self.message_format!r}: {e}") from None

    def _turns(self, messages: Sequence[Mapping[str, Any]], tools) -> list[str]:
        """Each turn as (role, content): tools after the first system message (or in one of their own), assistant
        calls after the content, each run of tool results as one user turn."""
        turns: list[tuple[str, str]] = []
        msgs = list(messages)
        if tools:
            first = msgs[0] if msgs and msgs[0]["role"] in ("system", "developer") else None
            head = (first.get("content") or "") + "\n\n" if first is not None and first.get("content") else ""
            turns.append(("system", head + tools_system_block(tools)))
            msgs = msgs[1:] if first is not None else msgs
        for m in msgs:
            role, content = m["role"], m.get("content") or ""
            if role == "tool":
                if turns and turns[-1][0] == "tool":
                    turns[-1][1].append(content)
                else:
                    turns.append(("tool", [content]))
                continue
            if role == "assistant" and m.get("tool_calls"):
                content = (content + "\n" if content else "") + render_tool_calls(m["tool_calls"])
            turns.append((role, content))
        return [self.message_format.format(role="user", content=render_tool_results(c)) if r == "tool"
                else self.message_format.format(role=r, content=c) for r, c in turns]

    def render(self, messages: Sequence[Mapping[str, Any]], tools=None, tool_choice=None,
               reasoning_effort=None) -> str:
        """The prompt for ``messages`` ([{"role": ..., "content": ...}, ...], content as plain text), ending in the
        generation prompt and, for a forced tool call, its prefix."""
        if not messages:
            raise ChatError("messages is empty; send at least one message")
        refuse_tools_and_effort("ChatML", None, None, reasoning_effort)
        check_tool_choice(tools, tool_choice)
        declared = tools if tools and tool_choice != "none" else None
        return "".join(self._turns(messages, declared)) + self.generation_prompt + forced_prefix(declared, tool_choice)

    def prompt(self, tokenizer, messages, tools=None, tool_choice=None, reasoning_effort=None) -> ChatPrompt:
        ids = encode(tokenizer, self.render(messages, tools, tool_choice, reasoning_effort))
        if not tools or tool_choice == "none":
            return ChatPrompt(ids, PlainOutput())
        parser = HermesOutput(tools_by_name(tools))
        parser.feed(forced_prefix(tools, tool_choice))  # the prefilled start of the call: nothing to emit yet
        return ChatPrompt(ids, parser)

    def completion_ids(self, tokenizer, message: Mapping[str, Any], thinking: bool = False) -> list[int]:
        """The tokens the model writes for the assistant ``message`` after ``prompt``: its content, its tool calls
        (Hermes) and the first stop string (what ends generation). ``thinking`` is refused: the format has no
        thinking channel."""
        refuse_tools_and_effort("ChatML", None, None, "thinking" if thinking else None)
        content = message.get("content") or ""
        if message.get("tool_calls"):
            content = (content + "\n" if content else "") + render_tool_calls(message["tool_calls"])
        return encode(tokenizer, content + self.stop[0])
