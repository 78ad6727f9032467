"""Log-likelihoods from one model forward over packed sequences, and the perplexity / bits per byte of a text.

Legend: T packed tokens, V vocab. Several sequences run as one packed row with ``cu_seqlens`` (documents never see
each other, SPEC §2), so scoring many short requests costs no padding.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = ["score_sequences", "rolling_windows", "score_text", "TextScore", "prefix_id"]


def prefix_id(tokenizer) -> int:
    """The token a text's first token is predicted from: BOS when the tokenizer has one, else end-of-document."""
    from ..data.tokenizer import eos_id

    bos = getattr(tokenizer, "bos_token_id", None)
    return eos_id(tokenizer) if bos is None else bos


@torch.no_grad()
def score_sequences(model, items: Sequence[tuple[Sequence[int], int]], max_tokens: int = 2048
                    ) -> list[tuple[list[float], list[bool]]]:
    """For each ``(tokens, n)``: the log-probabilities of the last ``n`` tokens, each given all tokens before it,
    and whether each is the model's greedy choice. Sequences are packed into rows of at most ``max_tokens``
    inputs (a longer one runs alone)."""
    out: list[tuple[list[float], list[bool]] | None] = [None] * len(items)
    for k, (tokens, n) in enumerate(items):
        if not 1 <= n <= len(tokens) - 1:
            raise ValueError(f"item {k}: scores {n} of {len(tokens)} tokens; the first token has nothing to be "
                             "predicted from, so 1 <= n <= len(tokens) - 1")
    device = next(model.parameters()).device
    order = sorted(range(len(items)), key=lambda i: -len(items[i][0]))  # long first: fuller packs
    pack: list[int] = []

    def run(pack):
        inputs = [list(items[i][0][:-1]) for i in pack]
        cu = torch.tensor([0] + [len(x) for x in inputs], device=device).cumsum(0)
        ids = torch.tensor([t for x in inputs for t in x], device=device)[None]
        logp = torch.log_softmax(model(ids, cu_seqlens=cu if len(pack) > 1 else None).logits[0].float(), -1)  # [T,V]
        for j, i in enumerate(pack):
            tokens, n = items[i]
            end = int(cu[j + 1])
            rows = logp[end - n:end]  # predictions of the last n tokens
            tgt = torch.tensor(tokens[-n:], device=device)
            out[i] = (rows.gather(1, tgt[:, None])[:, 0].tolist(), (rows.argmax(-1) == tgt).tolist())

    used = 0
    for i in order:
        size = len(items[i][0]) - 1
        if pack and used + size > max_tokens:
            run(pack)
            pack, used = [], 0
        pack.append(i)
        used += size
    if pack:
        run(pack)
    return out


def rolling_windows(tokens: Sequence[int], prefix: int, max_length: int) -> list[tuple[list[int], int]]:
    """Every token of ``tokens`` scored once, in windows of at most ``max_length`` model inputs: the first window
    predicts up to ``max_length`` tokens from ``prefix`` (the document separator) on; each later one predicts the
    next ``max_length`` (or the rest) from as many tokens before them as fit. lm-evaluation-harness's windows
    (``get_rolling_token_windows(..., context_len=1)`` made disjoint), as ``(sequence, n scored)`` items."""
    if max_length < 1:
        raise ValueError(f"max_length must be >= 1; got {max_length}")
    tokens = list(tokens)
    first = min(max_length, len(tokens))
    items = [([prefix] + tokens[:first], first)] if tokens else []
    done = first
    while done < len(tokens):
        end = done + min(len(tokens) - done, max_length)
        items.append((tokens[end - max_length - 1:end], end - done))
        done = end
    return items


@dataclass(frozen=True)
class TextScore:
    tokens: int
    bytes: int
    nll: float  # total negative log-likelihood, nats

    @property
    def loss(self) -> float:
        """Nats per token."""
        return self.nll / self.tokens

    @property
    def perplexity(self) -> float:
        return math.exp(self.loss)

    @property
    def bits_per_byte(self) -> float:
        """Bits per UTF-8 byte of the text: comparable across tokenizers."""
        return self.nll / math.log(2) / self.bytes

    def as_dict(self) -> dict:
        return {"tokens": self.tokens, "bytes": self.bytes, "nll": self.nll, "loss": self.loss,
                "perplexity": self.perplexity, "bits_per_byte": self.bits_per_byte}


def score_text(model, tokenizer, text: str, max_length: int = 2048, max_tokens: int = 2048) -> TextScore:
    """Perplexity and bits per byte of ``text``: every token predicted, the first from ``prefix_id``."""
    from ..data.tokenizer import encode

    ids = encode(tokenizer, text)
    if not ids:
        raise ValueError("the text encodes to no tokens; give some text")
    scored = score_sequences(model, rolling_windows(ids, prefix_id(tokenizer), max_length), max_tokens)
    return TextScore(len(ids), len(text.encode("utf-8")), -sum(sum(lp) for lp, _ in scored))
