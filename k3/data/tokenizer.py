"""A byte-level BPE tokenizer trained with Hugging Face ``tokenizers``; helpers to encode, decode and measure.

Byte-level (GPT-2 style) pre-tokenizer and decoder, no normalizer: every string round-trips exactly, whatever
its script. ``<|endoftext|>`` is id 0 and separates documents in the packed stream (see packing.py). A literal
``<|endoftext|>`` inside a document's text is encoded as ordinary bytes, so data can never forge a separator.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from functools import lru_cache
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from ..atomic import write_text_atomic
from .corpus import Document

__all__ = ["EOS", "train_tokenizer", "save_tokenizer", "load_tokenizer", "encode", "encode_documents",
           "decode", "eos_id", "unigram_entropy", "byte_alphabet"]

EOS = "<|endoftext|>"
TOKENIZER_FILE = "tokenizer.json"
N_BYTES = 256  # the byte-level alphabet: every byte has a token, so nothing is ever unknown


def _texts(documents: Iterable[Document | str]) -> Iterable[str]:
    for d in documents:
        yield d.text if isinstance(d, Document) else d


def _prepare(tok: Tokenizer) -> Tokenizer:
    tok.encode_special_tokens = True  # "<|endoftext|>" in text stays text; EOS ids come from eos_id() only
    return tok


def train_tokenizer(documents: Iterable[Document | str], vocab_size: int, *, min_frequency: int = 2,
                    special_tokens: Sequence[str] = (EOS,)) -> Tokenizer:
    """Byte-level BPE with ``vocab_size`` entries at most (fewer when the corpus runs out of pairs that occur
    ``min_frequency`` times). ``special_tokens`` take the first ids, so ``<|endoftext|>`` is id 0.
    Deterministic: the same documents give the same tokenizer.json, byte for byte."""
    special_tokens = list(special_tokens)
    if EOS not in special_tokens:
        raise ValueError(f"special_tokens must include the document separator {EOS!r}; got {special_tokens}")
    minimum = N_BYTES + len(special_tokens)
    if vocab_size < minimum:
        raise ValueError(f"vocab_size={vocab_size} is too small: a byte-level BPE needs {N_BYTES} byte tokens + "
                         f"{len(special_tokens)} special token(s) = {minimum} at least; use a larger vocab_size")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency, show_progress=False,
                                  special_tokens=special_tokens, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_texts(documents), trainer=trainer)
    return _prepare(tok)


def save_tokenizer(tok: Tokenizer, path: str | os.PathLike) -> Path:
    """Write ``tokenizer.json`` into the directory ``path`` (or to ``path`` itself when it ends in .json),
    atomically: a reader sees the old file or the new one, never half of one. Returns the file written."""
    path = Path(path)
    target = path if path.suffix == ".json" else path / TOKENIZER_FILE
    target.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(target, tok.to_str())
    return target


def load_tokenizer(path: str | os.PathLike):
    """Load from a directory holding ``tokenizer.json`` or from the json file itself; a directory holding a Kimi
    release's ``tiktoken.model`` gives a ``KimiTokenizer`` (k3.data.kimi_tokenizer) instead."""
    from .kimi_tokenizer import KimiTokenizer, is_kimi_tokenizer_dir

    path = Path(path)
    if path.is_dir() and is_kimi_tokenizer_dir(path):
        return KimiTokenizer.from_dir(path)
    file = path / TOKENIZER_FILE if path.is_dir() else path
    if not file.is_file():
        raise FileNotFoundError(f"no tokenizer at {str(file)!r}; pass a directory holding {TOKENIZER_FILE} "
                                "or the path of the json file (train one with train_tokenizer + save_tokenizer)")
    try:
        tok = Tokenizer.from_file(str(file))
    except Exception as e:  # noqa: BLE001 - tokenizers raises a bare Exception for any unreadable file
        raise ValueError(f"{file} is not a valid tokenizer.json ({e}); replace it with the tokenizer.json of the "
                         "run or model it belongs to") from None
    return _prepare(tok)


def eos_id(tok: Tokenizer) -> int:
    """The id that ends a document: ``<|endoftext|>`` in k3's BPE, the configured ``eos_token`` of a Kimi one."""
    if getattr(tok, "eos_token_id", None) is not None:
        return tok.eos_token_id
    i = tok.token_to_id(EOS)
    if i is None:
        raise ValueError(f"tokenizer has no {EOS!r} token; train it with k3.data.train_tokenizer")
    return i


def encode(tok: Tokenizer, text: str) -> list[int]:
    """Token ids of ``text``, without EOS (packing adds the separators)."""
    return tok.encode(text, add_special_tokens=False).ids


def encode_documents(tok: Tokenizer, documents: Iterable[Document | str]) -> list[list[int]]:
    """``encode`` over many documents at once (in parallel inside ``tokenizers``), order kept."""
    return [e.ids for e in tok.encode_batch(list(_texts(documents)), add_special_tokens=False)]


def decode(tok: Tokenizer, ids: Sequence[int] | torch.Tensor) -> str:
    """Text of ``ids``; special tokens are kept (EOS reads as ``<|endoftext|>``) so decode(encode(t)) == t."""
    if isinstance(ids, torch.Tensor):
        ids = ids.flatten().tolist()
    return tok.decode(list(ids), skip_special_tokens=False)


def unigram_entropy(token_ids: Sequence[int] | torch.Tensor) -> float:
    """Entropy in nats per token of the stream's unigram distribution: the loss of a model that knows only
    token frequencies, so a trained LM's loss should fall well below it. Divide by ln 2 for bits."""
    ids = torch.as_tensor(token_ids).flatten().long()
    if ids.numel() == 0:
        raise ValueError("unigram_entropy needs at least one token; got an empty stream")
    if int(ids.min()) < 0:
        raise ValueError(f"token ids must be non-negative; got {int(ids.min())}")
    counts = torch.bincount(ids).double()
    p = counts[counts > 0] / ids.numel()
    return max(float(-(p * p.log()).sum()), 0.0)  # max: one symbol gives -0.0


@lru_cache(maxsize=1)
def byte_alphabet() -> list[str]:
    """GPT-2's byte-level alphabet (what byte-level BPEs spell tokens in): the printable character of each byte."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    table = [""] * 256
    for b, c in zip(bs, cs):
        table[b] = chr(c)
    return table
