"""Chat messages -> prompt token ids, and the assistant's text -> its message (content, reasoning, tool calls).

Three chat formats, chosen by ``chat_template_for(tokenizer)``:
- ``KimiK3Chat`` (k3/serve/xtml.py), when the tokenizer has K3's XTML special tokens (``<|open|>`` ...): K3's
  format, with OpenAI ``tools`` / ``tool_calls`` / ``role: "tool"`` messages.
- ``JinjaChatTemplate``, when the tokenizer brings a chat template (``tokenizer_config.json``'s ``chat_template``, as
  Kimi K2 / K2.5 / Kimi Linear ship it): rendered with jinja2 as transformers' ``apply_chat_template`` renders it
  (``messages``, ``tools``, ``add_generation_prompt``, ``bos_token``, ``eos_token``). When the tokenizer has Kimi
  K2's tool-call tokens (``<|tool_calls_section_begin|>`` ...) the template gets the request's ``tools`` and the
  reply's calls are parsed (k3/serve/k2_tools.py); otherwise no tool calls.
- ``ChatTemplate``: ChatML, for k3's own byte-level tokenizer. Each message renders as

      <|im_start|>{role}\\n{content}<|im_end|>\\n

  and the prompt ends with the generation prompt ``<|im_start|>assistant\\n``; generation stops at ``<|im_end|>``
  (added to the request's stop strings; never returned). k3's byte-level tokenizer encodes the markers as ordinary
  text, so a model fine-tuned on ChatML-formatted text follows it, and content can forge turns exactly as it could
  in the training text. No tool calls.

Every format gives ``prompt(tokenizer, messages, tools, tool_choice, reasoning_effort) -> ChatPrompt``: the ids
and a parser that turns the streamed completion text into ``OutputEvent``s; ChatML and K3's format also give
``completion_ids(tokenizer, message, thinking)``: the tokens the model writes for an assistant message after the
prompt (the targets of fine-tuning, k3.post).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["ChatTemplate", "JinjaChatTemplate", "ChatPrompt", "ChatError", "OutputEvent", "chat_template_for",
           "DEFAULT_MESSAGE_FORMAT", "DEFAULT_GENERATION_PROMPT", "DEFAULT_STOP"]

DEFAULT_MESSAGE_FORMAT = "<|im_start|>{role}\n{content}<|im_end|>\n"
DEFAULT_GENERATION_PROMPT = "<|im_start|>assistant\n"
DEFAULT_STOP = ("<|im_end|>",)


class ChatError(ValueError):
    """Messages or tools a chat format cannot render; ``param`` names the request field."""

    def __init__(self, message: str, param: str = "messages"):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class OutputEvent:
    """A piece of the assistant's message: ``kind`` "content" / "reasoning" (``text``), "tool_call" (``text`` = the
    arguments as JSON, ``name``, ``id``), or "error" (``text`` = malformed tool output, returned as content, and
    ``name`` = what was wrong)."""

    kind: str
    text: str
    name: str = ""
    id: str = ""


class PlainOutput:
    """A format without tool calls: all text is content."""

    def feed(self, text: str) -> list[OutputEvent]:
        return [OutputEvent("content", text)] if text else []

    def finish(self) -> list[OutputEvent]:
        return []


@dataclass
class ChatPrompt:
    ids: list[int]
    parser: Any  # feed(text) / finish() -> list[OutputEvent]


def tool_name_of_call(call: Mapping) -> str:
    return (call.get("function") or {}).get("name", "")


def tools_by_name(tools: Sequence[Mapping] | None) -> dict[str, dict]:
    return {t["function"]["name"]: dict(t) for t in tools or ()}


def check_tool_choice(tools: Sequence[Mapping] | None, tool_choice: Any) -> None:
    if isinstance(tool_choice, Mapping):
        name = (tool_choice.get("function") or {}).get("name")
        if name not in tools_by_name(tools):
            raise ChatError(f"tool_choice names the function {name!r}, which is not among the tools "
                            f"{sorted(tools_by_name(tools))}", "tool_choice")
    elif tool_choice == "required" and not tools:
        raise ChatError("tool_choice 'required' needs tools", "tool_choice")


def _plain(fmt: str, tools, tool_choice, reasoning_effort) -> None:
    """A format without tool calls or a thinking channel refuses both, naming the field."""
    if tools and tool_choice != "none":
        raise ChatError(f"this model's chat format ({fmt}) has no tool-call format: k3 cannot tell its tool calls "
                        "from text; leave tools out, or serve a model whose tokenizer has K3's chat format", "tools")
    if reasoning_effort is not None:
        raise ChatError(f"reasoning_effort is not supported by this model's chat format ({fmt}); leave it out",
                        "reasoning_effort")


def _encode(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False).ids


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
        _plain("ChatML", tools, tool_choice, reasoning_effort)
        parts = [self.message_format.format(role=m["role"], content=m.get("content") or "") for m in messages]
        return "".join(parts) + self.generation_prompt

    def prompt(self, tokenizer, messages, tools=None, tool_choice=None, reasoning_effort=None) -> ChatPrompt:
        return ChatPrompt(_encode(tokenizer, self.render(messages, tools, tool_choice, reasoning_effort)), PlainOutput())

    def completion_ids(self, tokenizer, message: Mapping[str, Any], thinking: bool = False) -> list[int]:
        """The tokens the model writes for the assistant ``message`` after ``prompt``: its content and the first
        stop string (what ends generation). ``thinking`` is refused: the format has no thinking channel."""
        _plain("ChatML", None, None, "thinking" if thinking else None)
        return _encode(tokenizer, (message.get("content") or "") + self.stop[0])


@dataclass(frozen=True)
class JinjaChatTemplate:
    """A Jinja chat template (``tokenizer_config.json``'s ``chat_template``), rendered in jinja2's sandbox with the
    variables transformers passes; ``stop``: the strings that end the assistant's turn."""

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
            _plain("a Jinja chat template", tools, tool_choice, reasoning_effort)
        else:
            _plain("a Jinja chat template", None, None, reasoning_effort)
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
        ids = _encode(tokenizer, self.render(messages, tools, tool_choice, reasoning_effort))
        if self.tool_format is None or not tools or tool_choice == "none":
            return ChatPrompt(ids, PlainOutput())
        from .k2_tools import K2Output

        return ChatPrompt(ids, K2Output(tools_by_name(tools)))

    def completion_ids(self, tokenizer, message, thinking: bool = False) -> list[int]:
        raise ChatError("a Jinja chat template does not say how an assistant message ends, so k3 cannot build "
                        "training targets in it; fine-tune with k3's tokenizer (ChatML) or K3's chat format")


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    import json

    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def chat_template_for(tokenizer):
    """The chat format the tokenizer's model was trained with: K3's when its special tokens are there, else the
    tokenizer's own Jinja chat template, else ChatML."""
    from .xtml import SPECIAL_TOKENS, KimiK3Chat

    specials = getattr(tokenizer, "special_tokens", None) or {}
    if all(t in specials for t in SPECIAL_TOKENS):
        return KimiK3Chat()
    source = getattr(tokenizer, "chat_template", None)
    if source:
        from .k2_tools import K2_TOOL_TOKENS

        # the turn ends at the eos token or, in Kimi's templates, at <|im_end|>
        stop = tuple(dict.fromkeys(t for t in (getattr(tokenizer, "eos_token", None), "<|im_end|>") if t in specials))
        k2 = all(t in specials for t in K2_TOOL_TOKENS)
        return JinjaChatTemplate(source, stop, getattr(tokenizer, "bos_token", None),
                                 getattr(tokenizer, "eos_token", None), "kimi_k2" if k2 else None)
    return ChatTemplate()
