"""A tokenizer's own Jinja chat template (``tokenizer_config.json``'s ``chat_template``, as Kimi K2 / K2.5 / Kimi
Linear ship it), rendered with jinja2 as transformers' ``apply_chat_template`` renders it (``messages``, ``tools``,
``add_generation_prompt``, ``bos_token``, ``eos_token``). When the tokenizer has Kimi K2's tool-call tokens the
template gets the request's ``tools`` and the reply's calls are parsed (k3/chat/k2_tools.py); otherwise no tool
calls."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass

from .base import ChatError, ChatPrompt, PlainOutput, check_tool_choice, encode, refuse_tools_and_effort, tools_by_name
from .k2_tools import K2Output

__all__ = ["JinjaChatTemplate"]


@dataclass(frozen=True)
class JinjaChatTemplate:
    """A Jinja chat template, rendered in jinja2's sandbox with the variables transformers passes; ``stop``: the
    strings that end the assistant's turn."""

    source: str
    stop: tuple[str, ...] = ()
    bos_token: str | None = None
    eos_token: str | None = None
    tool_format: str | None = None  # "kimi_k2": the tokenizer has K2's tool-call tokens; None: no tool calls
    supports_thinking = False

    @property
    def supports_tools(self) -> bool:
        return self.tool_format is not None

    def render(self, messages, tools=None, tool_choice=None, reasoning_effort=None) -> str:
        import jinja2
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        if not messages:
            raise ChatError("messages is empty; send at least one message")
        if self.tool_format is None:
            refuse_tools_and_effort("a Jinja chat template", tools, tool_choice, reasoning_effort)
        else:
            refuse_tools_and_effort("a Jinja chat template", None, None, reasoning_effort)
            check_tool_choice(tools, tool_choice)
            if tool_choice == "required" or isinstance(tool_choice, Mapping):
                raise ChatError("tool_choice 'required' or a named function cannot be forced in Kimi K2's format "
                                "(its template has no way to start a call); use 'auto' or 'none'", "tool_choice")
            if tool_choice == "none":
                tools = None

        def raise_exception(message):
            raise ChatError(f"the chat template refused the messages: {message}")

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=["jinja2.ext.loopcontrols"])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = raise_exception
        try:
            return env.from_string(self.source).render(
                messages=list(messages), tools=list(tools) if tools else None, add_generation_prompt=True,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "")
        except jinja2.TemplateError as e:
            raise ChatError(f"the chat template failed to render: {e}") from None

    def prompt(self, tokenizer, messages, tools=None, tool_choice=None, reasoning_effort=None) -> ChatPrompt:
        ids = encode(tokenizer, self.render(messages, tools, tool_choice, reasoning_effort))
        if self.tool_format is None or not tools or tool_choice == "none":
            return ChatPrompt(ids, PlainOutput())
        return ChatPrompt(ids, K2Output(tools_by_name(tools)))

    def completion_ids(self, tokenizer, message, thinking: bool = False) -> list[int]:
        raise ChatError("a Jinja chat template does not say how an assistant message ends, so k3 cannot build "
                        "training targets in it; fine-tune with k3's tokenizer (ChatML) or K3's chat format")


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)
