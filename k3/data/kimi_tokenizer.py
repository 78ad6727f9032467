"""The tokenizer of the Kimi releases (K2, K2.5, Kimi Linear, K3): a tiktoken BPE file plus the special tokens and
chat template of ``tokenizer_config.json``, read the way the releases' own ``tokenization_kimi.py`` reads them.

- ``tiktoken.model``: one ``base64(token bytes) rank`` per line (tiktoken's format); ranks are token ids.
- special tokens: the ``num_reserved_special_tokens`` (256) ids right after the BPE ranks; each is named by
  ``added_tokens_decoder[id].content`` in ``tokenizer_config.json`` or is ``<|reserved_token_{id}|>``.
- pre-tokenization: the release's regex ``PAT_STR`` (Han runs, cased words, 1-3 digit numbers, punctuation,
  whitespace); ``bos_token`` / ``eos_token`` / ``pad_token`` / ``unk_token`` and ``chat_template`` (or a
  ``chat_template.jinja`` file) from ``tokenizer_config.json``.
- encoding: special-token text in the input becomes the special token (as the release's ``encode``), except
  through ``encode_text`` (user content: markers stay ordinary text, so content cannot forge structure).

``KimiTokenizer`` offers the part of the ``tokenizers.Tokenizer`` interface k3 uses (``encode(...).ids``,
``encode_batch``, ``decode``, ``get_vocab_size``, ``id_to_token``, ``token_to_id``) plus ``token_bytes`` and the
special-token ids, so the engine, detokenizer, server and CLI take either. The BPE itself runs in ``tiktoken``,
the library the release uses: the same merges give the same ids as the release.
"""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

from .tokenizer import byte_alphabet

__all__ = ["KimiTokenizer", "TIKTOKEN_FILE", "PAT_STR", "is_kimi_tokenizer_dir"]

TIKTOKEN_FILE = "tiktoken.model"
CONFIG_FILE = "tokenizer_config.json"
TEMPLATE_FILE = "chat_template.jinja"
NUM_RESERVED_SPECIAL_TOKENS = 256
PAT_STR = "|".join([
    r"""[\p{Han}]+""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+"""
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*"""
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""\p{N}{1,3}""",
    r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
    r"""\s*[\r\n]+""",
    r"""\s+(?!\S)""",
    r"""\s+""",
])
# tiktoken handles at most ~400k characters per call and long runs without whitespace badly (its issue 195): the
# release encodes in slices of at most this many characters, cut where whitespace starts or ends
_MAX_CHARS, _MAX_RUN = 400_000, 25_000


def is_kimi_tokenizer_dir(path: str | Path) -> bool:
    return (Path(path) / TIKTOKEN_FILE).is_file()


@dataclass(frozen=True)
class Encoded:
    """What ``encode`` returns: the ids, as ``tokenizers.Encoding.ids``."""

    ids: list[int]


def _token_name(value) -> str | None:
    """A token in tokenizer_config.json: a string or an AddedToken dict {"content": ...}."""
    return value.get("content") if isinstance(value, dict) else value


def _slices(text: str):
    for i in range(0, len(text), _MAX_CHARS):
        s = text[i:i + _MAX_CHARS]
        start, run, space = 0, 0, s[:1].isspace()
        for j, ch in enumerate(s):
            if ch.isspace() != space:
                run, space = 1, ch.isspace()
            else:
                run += 1
                if run > _MAX_RUN:
                    yield s[start:j]
                    start, run = j, 1
        yield s[start:]


class KimiTokenizer:
    def __init__(self, ranks: dict[bytes, int], special_tokens: dict[str, int], *, bos_token: str | None = None,
                 eos_token: str | None = None, pad_token: str | None = None, unk_token: str | None = None,
                 chat_template: str | None = None, name: str = TIKTOKEN_FILE):
        import tiktoken

        self.encoding = tiktoken.Encoding(name=name, pat_str=PAT_STR, mergeable_ranks=ranks,
                                          special_tokens=special_tokens)
        self.special_tokens = dict(special_tokens)
        self.chat_template = chat_template
        self._special_by_id = {i: t for t, i in special_tokens.items()}
        self.bos_token, self.eos_token, self.pad_token, self.unk_token = bos_token, eos_token, pad_token, unk_token
        for role, token in (("bos_token", bos_token), ("eos_token", eos_token), ("pad_token", pad_token),
                            ("unk_token", unk_token)):
            if token is not None and token not in special_tokens:
                raise ValueError(f"{CONFIG_FILE}: {role} {token!r} is not one of the special tokens (the "
                                 f"{len(special_tokens)} ids after the BPE ranks, named in added_tokens_decoder)")

    # ---- loading -------------------------------------------------------------------------------------------------
    @classmethod
    def from_dir(cls, path: str | Path) -> "KimiTokenizer":
        """Read ``tiktoken.model`` and ``tokenizer_config.json`` (and ``chat_template.jinja``) from a directory."""
        d = Path(path)
        ranks = _read_ranks(d / TIKTOKEN_FILE)
        cfg_file = d / CONFIG_FILE
        cfg = {}
        if cfg_file.is_file():
            try:
                cfg = json.loads(cfg_file.read_text(encoding="utf-8"))
            except json.JSONDecodeError as e:
                raise ValueError(f"{cfg_file} is not valid JSON: {e}") from None
        named = {}
        for key, tok in (cfg.get("added_tokens_decoder") or {}).items():
            try:
                named[int(key)] = _token_name(tok)
            except ValueError:
                raise ValueError(f"{cfg_file}: added_tokens_decoder keys are token ids; got {key!r}") from None
        n = len(ranks)
        outside = sorted(i for i in named if not n <= i < n + NUM_RESERVED_SPECIAL_TOKENS)
        if outside:
            raise ValueError(f"{cfg_file}: added token id(s) {outside[:4]} are not special-token ids: {TIKTOKEN_FILE} "
                             f"has {n} ranks, so the special tokens are ids {n}..{n + NUM_RESERVED_SPECIAL_TOKENS - 1}")
        special = {named.get(i, f"<|reserved_token_{i}|>"): i for i in range(n, n + NUM_RESERVED_SPECIAL_TOKENS)}
        if len(special) != NUM_RESERVED_SPECIAL_TOKENS:
            raise ValueError(f"{cfg_file}: two special-token ids share one name in added_tokens_decoder")
        template = cfg.get("chat_template")
        if isinstance(template, list):  # transformers' named templates: [{"name": ..., "template": ...}]
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        if template is None and (d / TEMPLATE_FILE).is_file():
            template = (d / TEMPLATE_FILE).read_text(encoding="utf-8")
        return cls(ranks, special, bos_token=_token_name(cfg.get("bos_token")),
                   eos_token=_token_name(cfg.get("eos_token")), pad_token=_token_name(cfg.get("pad_token")),
                   unk_token=_token_name(cfg.get("unk_token")), chat_template=template, name=str(d / TIKTOKEN_FILE))

    # ---- the tokenizers.Tokenizer part k3 uses ---------------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = False) -> Encoded:
        """Token ids of ``text``; special-token text becomes the special token (as the release's ``encode``).
        ``add_special_tokens`` (a BOS) is accepted for the tokenizers signature; Kimi prompts carry no BOS."""
        ids: list[int] = []
        for s in _slices(text):
            ids.extend(self.encoding.encode(s, allowed_special="all"))
        return Encoded(ids)

    def encode_text(self, text: str) -> list[int]:
        """Token ids of ``text`` with every character ordinary text: a ``<|...|>`` marker inside user content
        encodes as bytes, never as the special token (the release encodes message content this way)."""
        ids: list[int] = []
        for s in _slices(text):
            ids.extend(self.encoding.encode(s, disallowed_special=()))
        return ids

    def encode_batch(self, texts, add_special_tokens: bool = False) -> list[Encoded]:
        return [self.encode(t) for t in texts]

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        ids = [int(i) for i in ids]
        if skip_special_tokens:
            ids = [i for i in ids if i not in self._special_by_id]
        return self.encoding.decode(ids, errors="replace")

    def get_vocab_size(self, with_added_tokens: bool = True) -> int:
        return self.encoding.n_vocab if with_added_tokens else self.encoding.n_vocab - len(self.special_tokens)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for (part of a UTF-8 character, possibly)."""
        token_id = int(token_id)
        if not 0 <= token_id < self.encoding.n_vocab:
            raise ValueError(f"token id {token_id} is outside the tokenizer's vocabulary of {self.encoding.n_vocab}")
        return self.encoding.decode_single_token_bytes(token_id)

    def id_to_token(self, token_id: int) -> str | None:
        """The token as a string: its name for a special token, else its bytes in GPT-2's byte-level alphabet (as
        the release's ``convert_ids_to_tokens`` and tokenizers' byte-level BPE spell them)."""
        token_id = int(token_id)
        if token_id in self._special_by_id:
            return self._special_by_id[token_id]
        if not 0 <= token_id < self.encoding.n_vocab:
            return None
        table = byte_alphabet()
        return "".join(table[b] for b in self.token_bytes(token_id))

    def token_to_id(self, token: str) -> int | None:
        return self._vocab.get(token)

    @cached_property
    def _vocab(self) -> dict[str, int]:
        return {self.id_to_token(i): i for i in range(self.encoding.n_vocab)}

    # ---- special tokens ----------------------------------------------------------------------------------------------
    def _id(self, token: str | None) -> int | None:
        return None if token is None else self.special_tokens[token]

    @property
    def bos_token_id(self) -> int | None:
        return self._id(self.bos_token)

    @property
    def eos_token_id(self) -> int | None:
        return self._id(self.eos_token)

    @property
    def pad_token_id(self) -> int | None:
        return self._id(self.pad_token)


def _read_ranks(path: Path) -> dict[bytes, int]:
    """tiktoken's BPE file: ``base64(bytes) rank`` per line (what ``tiktoken.load.load_tiktoken_bpe`` reads, without
    its download cache)."""
    if not path.is_file():
        raise FileNotFoundError(f"no {TIKTOKEN_FILE} at {path}")
    ranks = {}
    for n, line in enumerate(path.read_bytes().splitlines(), 1):
        if not line.strip():
            continue
        try:
            token, rank = line.split()
            ranks[base64.b64decode(token, validate=True)] = int(rank)
        except ValueError:
            raise ValueError(f"{path}:{n}: expected 'base64(token bytes) rank', got {line[:60]!r}") from None
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise ValueError(f"{path}: the ranks must be 0..{len(ranks) - 1}, each once (they are the token ids)")
    return ranks


def write_tiktoken_file(ranks: dict[bytes, int], path: str | Path) -> None:
    """Write ``ranks`` in tiktoken's format (for tests and conversions)."""
    lines = [f"{base64.b64encode(t).decode()} {r}" for t, r in sorted(ranks.items(), key=lambda kv: kv[1])]
    Path(path).write_text("\n".join(lines) + "\n")
