"""The markup of K3's chat format (k3/chat/xtml.py): every span is
``<|open|>NAME attrs<|sep|> ... <|close|>NAME<|sep|>``, attribute values escaping ``&`` and ``"``; a message ends
with ``<|end_of_msg|>``."""

from __future__ import annotations

from typing import Any

__all__ = ["OPEN", "CLOSE", "SEP", "END_OF_MSG", "SPECIAL_TOKENS", "escape_attr", "open_tag", "close_tag"]

OPEN, CLOSE, SEP, END_OF_MSG = "<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>"
SPECIAL_TOKENS = (OPEN, CLOSE, SEP, END_OF_MSG)


def escape_attr(value: Any) -> str:
    return str(value).replace("&", "&amp;").replace('"', "&quot;")


def open_tag(tag: str, **attrs) -> str:
    return OPEN + tag + "".join(f' {k}="{escape_attr(v)}"' for k, v in attrs.items()) + SEP


def close_tag(tag: str) -> str:
    return CLOSE + tag + SEP
