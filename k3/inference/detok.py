"""Streaming text out of streaming tokens: incremental detokenization and stop strings (SPEC §7).

Byte-level BPE splits UTF-8 characters across tokens ("漢" is three bytes, often two or three tokens), and
decoding a prefix that ends mid-character yields U+FFFD. ``IncrementalDetokenizer`` decodes a small window of
recent tokens (vLLM's prefix/read offsets) and emits only text that can no longer change: while the window's
text ends in U+FFFD it holds the text back, so what it emits, joined, is exactly ``decode(all ids)``.

``StopMatcher`` cuts the text exactly before the first stop string, even one split across deltas, by holding
back any suffix that could still grow into a stop string.

``token_bytes`` / ``token_text`` give one token's own bytes and display string, for OpenAI-style logprobs.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache

from tokenizers import Tokenizer, decoders

from ..data.tokenizer import byte_alphabet

__all__ = ["IncrementalDetokenizer", "StopMatcher", "token_bytes", "token_text"]

REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Push completion token ids one at a time; get back the text each one completes (often "", mid-character).

    ``push`` returns only stable text; ``flush`` (at the end of the request) returns whatever is still held,
    invalid UTF-8 included. Joined, the returned pieces equal ``tokenizer.decode(ids)``."""

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = False):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self.text = ""  # everything emitted so far
        self._prefix = 0  # window start: decoding from here gives the same text as decoding from 0
        self._read = 0  # ids before this are emitted
        self._prefix_text = ""  # decode(ids[_prefix:_read])

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def _advance(self, final: bool) -> str:
        window = self._decode(self.ids[self._prefix:])
        if not final and (window.endswith(REPLACEMENT) or len(window) <= len(self._prefix_text)):
            return ""  # mid-character (or no new text yet): wait for the next token
        delta = window[len(self._prefix_text):]
        self._prefix, self._read = self._read, len(self.ids)
        self._prefix_text = self._decode(self.ids[self._prefix:self._read])
        self.text += delta
        return delta

    def push(self, token_id: int) -> str:
        self.ids.append(int(token_id))
        return self._advance(final=False)

    def flush(self) -> str:
        """The text still held back (an incomplete or invalid UTF-8 tail decodes to U+FFFD here)."""
        if self._read == len(self.ids):
            return ""
        return self._advance(final=True)


class StopMatcher:
    """Feed text deltas; get back the text that is safe to emit and whether a stop string was reached.

    Output stops exactly before the earliest stop string; a suffix that could be the start of a stop string is
    held back until the next delta settles it (``flush`` returns it when the request ends otherwise)."""

    def __init__(self, stops: Sequence[str] = ()):
        stops = tuple(stops)
        if any(not isinstance(s, str) or s == "" for s in stops):
            raise ValueError(f"stop strings must be non-empty strings; got {stops!r}")
        self.stops = stops
        self.stopped = False
        self._held = ""

    def _holdback(self, text: str) -> int:
        """Length of the longest suffix of ``text`` that is a proper prefix of some stop string."""
        for n in range(min(len(text), max(len(s) for s in self.stops) - 1), 0, -1):
            tail = text[-n:]
            if any(s.startswith(tail) for s in self.stops):
                return n
        return 0

    def feed(self, delta: str) -> tuple[str, bool]:
        if self.stopped:
            return "", True
        if not self.stops:
            return delta, False
        text = self._held + delta  # a match can only start inside the held part or the new delta
        hits = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.stopped, self._held = True, ""
            return text[:min(hits)], True
        n = self._holdback(text)
        self._held = text[len(text) - n:]
        return text[:len(text) - n], False

    def flush(self) -> str:
        """The held-back text, once no more deltas will come (it did not become a stop string)."""
        held, self._held = self._held, ""
        return "" if self.stopped else held


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet reversed: the printable stand-in character of each byte -> the byte."""
    return {c: b for b, c in enumerate(byte_alphabet())}


def token_bytes(tokenizer: Tokenizer, token_id: int) -> bytes:
    """The bytes one token stands for (a byte-level token may hold part of a UTF-8 character). A tokenizer that
    knows them itself (``KimiTokenizer.token_bytes``) is asked directly."""
    if hasattr(tokenizer, "token_bytes"):
        return tokenizer.token_bytes(token_id)
    piece = tokenizer.id_to_token(int(token_id))
    if piece is None:
        raise ValueError(f"token id {token_id} is outside the tokenizer's vocabulary of "
                         f"{tokenizer.get_vocab_size()} entries")
    added = tokenizer.get_added_tokens_decoder()
    table = _byte_decoder()
    if int(token_id) not in added and isinstance(tokenizer.decoder, decoders.ByteLevel) \
            and all(c in table for c in piece):
        return bytes(table[c] for c in piece)
    return tokenizer.decode([int(token_id)], skip_special_tokens=False).encode("utf-8")


def token_text(tokenizer: Tokenizer, token_id: int) -> str:
    """One token as display text (U+FFFD where it holds part of a character): the key for top-logprob maps."""
    return token_bytes(tokenizer, token_id).decode("utf-8", errors="replace")
