"""A training run's data: documents, the train/validation split, the tokenizer and the packed datasets.

User text is cut into documents at blank lines (``TrainConfig.max_doc_chars``), split by document, and the BPE is
learned from the training split (or read from the checkpoint on resume). A corpus too small to train on is
refused here with how much more text, or which smaller setting, would do.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ..data import (PackedDataset, encode_documents, eos_id, leading_documents, load_documents, load_tokenizer,
                    save_tokenizer, split_documents, stdlib_documents, train_tokenizer, unigram_entropy)


@dataclass
class RunData:
    tokenizer: object  # tokenizers.Tokenizer
    train: PackedDataset
    val: PackedDataset  # drop_last=False: every validation token is scored
    unigram_entropy: float  # of the validation tokens
    # (config, device, resume_from, init_dir) -> (model, trainer state or None), as k3.train.trainer.build_model
    # (the default, a text model); k3.post.sft_images' for a multimodal model
    build_model: Callable | None = None


def documents(cfg):
    if cfg.data is None:
        return stdlib_documents(cfg.data_max_bytes)
    docs = load_documents(cfg.data, max_chars=cfg.max_doc_chars)
    return leading_documents(docs, cfg.data_max_bytes) if cfg.data_max_bytes else docs


def split(cfg, docs):
    """(train, val) documents; a corpus of one document cannot hold out validation, and the error says so."""
    train_docs, val_docs = split_documents(docs, cfg.val_fraction, cfg.seed)
    if not val_docs:
        chars = sum(len(d.text) for d in docs)
        raise ValueError(f"the data ({cfg.data or 'the standard library'}) is one document of {chars:,} characters: "
                         "too little to hold out a validation split, which needs a document of its own. Give more "
                         f"text, or a --doc-chars below {chars} to cut it at blank lines into several documents")
    return train_docs, val_docs


def init_dir(cfg) -> Path | None:
    """``init_from``: a checkpoint directory, or a run directory holding ``checkpoint/``."""
    if not cfg.init_from:
        return None
    p = Path(cfg.init_from)
    p = p / "checkpoint" if (p / "checkpoint").is_dir() else p
    if not (p / "config.json").exists() or not (p / "tokenizer.json").exists():
        raise FileNotFoundError(f"--init-from {cfg.init_from}: no config.json and tokenizer.json there; point it at "
                                f"a k3 checkpoint directory (RUN/checkpoint)")
    return p


def _tokenizer(cfg, train_docs, run: Path, resume_from: Path | None):
    source = resume_from or init_dir(cfg)  # resuming, or fine-tuning a checkpoint: its tokenizer
    if source is not None:
        tok = load_tokenizer(source / "tokenizer.json")
        if not (run / "tokenizer.json").exists():
            save_tokenizer(tok, run / "tokenizer.json")
        return tok
    # learn the BPE on a prefix of the training split (deterministic)
    tok = train_tokenizer(leading_documents(train_docs, cfg.tokenizer_bytes), cfg.vocab_size)
    save_tokenizer(tok, run / "tokenizer.json")
    return tok


def _check_enough_tokens(cfg, n_tokens: int, train_docs) -> None:
    if n_tokens >= cfg.seq_len:
        return
    chars = sum(len(d.text) for d in train_docs)
    more = (cfg.seq_len - n_tokens) * chars / max(n_tokens, 1)  # at this corpus's characters per token
    raise ValueError(f"too little data: the training split is {n_tokens} tokens ({chars:,} characters), less than one "
                     f"sample of --seq-len {cfg.seq_len}; give at least ~{more:,.0f} more characters of text, or a "
                     f"--seq-len of at most {n_tokens}")


def prepare(cfg, run: Path, resume_from: Path | None, par) -> RunData:
    """Rank 0 learns (or copies) the tokenizer; every rank then builds the same datasets."""
    train_docs, val_docs = split(cfg, documents(cfg))
    tok = _tokenizer(cfg, train_docs, run, resume_from) if par.rank == 0 else None
    par.barrier()
    if tok is None:  # the other ranks read the tokenizer rank 0 trained (or the checkpoint's)
        tok = load_tokenizer((resume_from or run) / "tokenizer.json")
    eos = eos_id(tok)
    train_ids, val_ids = encode_documents(tok, train_docs), encode_documents(tok, val_docs)
    _check_enough_tokens(cfg, sum(len(x) + 1 for x in train_ids if x), train_docs)  # + 1: each document's EOS
    marked = cfg.packing == "documents"
    train_set = PackedDataset(train_ids, cfg.seq_len, eos, shuffle_seed=cfg.seed, boundaries=marked)
    val_set = PackedDataset(val_ids, cfg.seq_len, eos, shuffle_seed=None, drop_last=False, boundaries=marked)
    return RunData(tok, train_set, val_set, unigram_entropy(val_set.tokens))
