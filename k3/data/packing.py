"""Train/validation split by document, and packing of tokenized documents into fixed-length samples.

The stream is every document followed by EOS, back to back. Sample i is stream[i*T : (i+1)*T] (T = seq_len)
with ``cu_seqlens`` marking where documents start inside it: a document's EOS stays in its own segment (its
last token learns to predict EOS) and a document cut by a sample boundary goes on as a fresh segment in the
next sample. The model takes packed documents as batch 1, so a batch of B samples is one row of B*T tokens
whose cu_seqlens hold every segment: KDA resets its state and MLA masks at each boundary, and no position
predicts across one. Labels are the input ids (the model shifts inside). The last < T tokens are dropped.

``boundaries=False`` (``k3 train --packing stream``) packs the same stream without marking documents: every sample
is one segment (cu_seqlens [0, T]), attention and KDA's state cross documents with only the EOS between them, and
every position but a sample's last is a target (GPT-style pretraining; torchtitan's default).

Legend: T seq_len, B batch_size, N stream length, D documents, S segments in a sample or batch.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Sequence

import torch

__all__ = ["split_documents", "pack_stream", "pack", "PackedDataset", "count_targets", "media_inputs"]


def _hash64(text: str) -> int:
    """A 64-bit hash of ``text``, the same on every machine and run (unlike ``hash``)."""
    return int.from_bytes(hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest(), "big")


def split_documents(docs: Sequence, val_fraction: float = 0.05, seed: int = 0) -> tuple[list, list]:
    """(train, val): a document goes to val iff the hash of (seed, its id) < val_fraction. The side of a
    document depends on its id alone, so adding, removing or reordering others never moves it. Order is kept.
    When no document hashes into val but there are two or more (a small corpus), the one with the lowest hash
    goes to val, so that validation is never empty while it can be filled."""
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in [0, 1); got {val_fraction}")
    hashes = [_hash64(f"{seed}:{d.id}") for d in docs]
    to_val = [h < val_fraction * 2**64 for h in hashes]
    if val_fraction > 0 and not any(to_val) and len(docs) >= 2:
        to_val[hashes.index(min(hashes))] = True
    return [d for d, v in zip(docs, to_val) if not v], [d for d, v in zip(docs, to_val) if v]


def pack_stream(token_docs: Sequence[Sequence[int]], eos_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens [N] int32, doc_starts [D] int64): documents each followed by EOS, and where each one starts.
    Empty documents are skipped (they would be a lone EOS)."""
    docs = [torch.as_tensor(d, dtype=torch.int32) for d in token_docs if len(d)]
    lengths = torch.tensor([len(d) + 1 for d in docs], dtype=torch.int64)  # [D], + 1 for the EOS
    ends = lengths.cumsum(0)
    tokens = torch.full((int(ends[-1]) if len(docs) else 0,), eos_id, dtype=torch.int32)  # [N]
    for d, end in zip(docs, ends.tolist()):
        tokens[end - 1 - len(d): end - 1] = d
    return tokens, ends - lengths


def _check_labels(token_docs, label_docs) -> None:
    if len(label_docs) != len(token_docs) or any(len(a) != len(b) for a, b in zip(token_docs, label_docs)):
        raise ValueError("label_docs must have one label per token of every document (the same lengths as token_docs)")


def count_targets(cu_seqlens: torch.Tensor, labels: torch.Tensor | None, shift: int) -> int:
    """Positions of a packed row (cu_seqlens [S+1]) whose token ``shift`` ahead lies in the same document and, with
    ``labels`` ([T] or [1,T]), is a target (not -100)."""
    if labels is None:
        return int((cu_seqlens[1:] - cu_seqlens[:-1] - shift).clamp(min=0).sum())
    lab = labels.reshape(-1)
    doc = torch.repeat_interleave(torch.arange(len(cu_seqlens) - 1), cu_seqlens[1:] - cu_seqlens[:-1])
    return int(((doc[shift:] == doc[:-shift]) & (lab[shift:] != -100)).sum())


def media_inputs(batch: dict, device) -> dict:
    """The model's keyword inputs besides the tokens that a batch carries under "media" (a multimodal model's
    ``pixels``, ``grids``, ``image_tokens``: k3.post.sft_images), tensors on ``device``; {} for a text batch."""
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.get("media", {}).items()}


def _sample(tokens: torch.Tensor, doc_starts: torch.Tensor, i: int, seq_len: int):
    lo, hi = i * seq_len, min((i + 1) * seq_len, len(tokens))  # the last sample may be short (drop_last=False)
    a, b = torch.searchsorted(doc_starts, torch.tensor([lo + 1, hi])).tolist()  # starts strictly inside (lo, hi)
    inner = doc_starts[a:b] - lo
    cu_seqlens = torch.cat([torch.zeros(1, dtype=torch.int64), inner, torch.tensor([hi - lo])])  # [S+1]
    return tokens[lo:hi].long(), cu_seqlens  # input_ids [T] int64


def pack(token_docs: Sequence[Sequence[int]], seq_len: int, eos_id: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Every sample in stream order: [(input_ids [T] int64, cu_seqlens [S+1] int64), ...]."""
    ds = PackedDataset(token_docs, seq_len, eos_id, shuffle_seed=None)
    return [ds.sample(i) for i in range(len(ds))]


def _epoch_seed(shuffle_seed: int, epoch: int) -> int:
    return _hash64(f"{shuffle_seed}:{epoch}") >> 1  # manual_seed takes < 2**63


class PackedDataset:
    """Fixed-length samples over a packed token stream, shuffled per epoch, with a resumable batch cursor.

    ``batches`` walks an endless sequence of samples: epoch 0 in the order of a permutation seeded by
    (shuffle_seed, 0), then epoch 1, and so on (a batch may straddle two epochs). ``state_dict`` holds the
    cursor (epoch, position in that epoch's order), so a restored dataset yields exactly the next batches.
    ``shuffle_seed=None`` keeps stream order. One cursor per dataset: run one ``batches`` iterator at a time.
    ``drop_last=False`` keeps the last < T tokens as a shorter final sample (for validation: nothing unseen).
    ``label_docs`` (fine-tuning): per document, each token's training label, -100 where the token is no target
    (a chat's prompt: ``k3.post.sft_data``); batches then carry "labels", -100 at every EOS too. ``boundaries``:
    mark where documents start (True) or pack the stream as one segment per sample (False; see the module
    docstring).
    """

    def __init__(self, token_docs: Sequence[Sequence[int]], seq_len: int, eos_id: int,
                 shuffle_seed: int | None = 0, drop_last: bool = True, label_docs: Sequence[Sequence[int]] | None = None,
                 boundaries: bool = True):
        if seq_len < 1:
            raise ValueError(f"seq_len must be >= 1; got {seq_len}")
        self.seq_len, self.eos_id, self.shuffle_seed, self.boundaries = seq_len, eos_id, shuffle_seed, boundaries
        self.tokens, self.doc_starts = pack_stream(token_docs, eos_id)  # [N] int32, [D] int64
        self.labels = None  # [N] int32, -100 = not a target
        self.windows = len(self.tokens) // seq_len if drop_last else -(-len(self.tokens) // seq_len)
        if self.windows == 0:
            raise ValueError(f"the documents pack into {len(self.tokens)} tokens (EOS included), fewer than one "
                             f"sample of seq_len={seq_len}; use a smaller seq_len or more documents")
        self._window = torch.arange(self.windows)  # sample i is the stream's window _window[i]
        if label_docs is not None:
            _check_labels(token_docs, label_docs)
            kept = [lab for tok, lab in zip(token_docs, label_docs) if len(tok)]
            self.labels = pack_stream(kept, -100)[0]
            self._window = torch.tensor([w for w in range(self.windows) if self._has_targets(w)], dtype=torch.int64)
            if len(self._window) == 0:
                raise ValueError("no sample holds a training target (every label is -100): nothing to learn from")
        self.num_samples = len(self._window)
        self.epoch, self.position = 0, 0
        self._order_epoch, self._order = None, None

    def __len__(self) -> int:
        return self.num_samples

    @property
    def dropped_tokens(self) -> int:
        """Tokens at the end of the stream that fill no whole sample."""
        return max(len(self.tokens) - self.windows * self.seq_len, 0)

    def sample(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(input_ids [T] int64, cu_seqlens [S+1] int64) of sample i in stream order."""
        if not 0 <= i < self.num_samples:
            raise IndexError(f"sample {i} out of range: the dataset has {self.num_samples} samples")
        return self._window_sample(int(self._window[i]))

    def _window_sample(self, w: int) -> tuple[torch.Tensor, torch.Tensor]:
        ids, cu = _sample(self.tokens, self.doc_starts, w, self.seq_len)
        return (ids, cu) if self.boundaries else (ids, cu[[0, -1]])

    def _labels(self, i: int) -> torch.Tensor:
        w = int(self._window[i])
        return self.labels[w * self.seq_len: (w + 1) * self.seq_len].long()  # the tokens sample(i) holds

    def _has_targets(self, w: int) -> bool:
        """Whether window ``w`` has a target 1 and 2 tokens ahead (the next-token and the first MTP loss) inside a
        document: a window of prompt tokens only is left out (its losses would be 0/0)."""
        _, cu = self._window_sample(w)
        lab = self.labels[w * self.seq_len: (w + 1) * self.seq_len]
        return all(count_targets(cu, lab, d) > 0 for d in (1, 2))

    def order(self, epoch: int) -> torch.Tensor:
        """[num_samples] int64: the sample indices of ``epoch`` in the order ``batches`` visits them."""
        if self._order_epoch != epoch:
            if self.shuffle_seed is None:
                self._order = torch.arange(self.num_samples)
            else:
                g = torch.Generator().manual_seed(_epoch_seed(self.shuffle_seed, epoch))
                self._order = torch.randperm(self.num_samples, generator=g)
            self._order_epoch = epoch
        return self._order

    def collate(self, indices: Sequence[int]) -> dict[str, torch.Tensor]:
        """Samples packed into one row: {"input_ids" [1, B*T] int64, "cu_seqlens" [S+1] int64} (and "labels"
        [1, B*T] int64 with ``label_docs``)."""
        ids, cus = zip(*(self.sample(int(i)) for i in indices))
        starts = torch.tensor([0] + [len(x) for x in ids[:-1]]).cumsum(0).tolist()  # only a last sample is short
        offsets = [cu[1:] + s for s, cu in zip(starts, cus)]  # cu[0] = 0 is the previous cu[-1]
        batch = {"input_ids": torch.cat(ids).unsqueeze(0),
                 "cu_seqlens": torch.cat([torch.zeros(1, dtype=torch.int64), *offsets])}
        if self.labels is not None:
            batch["labels"] = torch.cat([self._labels(int(i)) for i in indices]).unsqueeze(0)
        return batch

    def batches(self, batch_size: int, start_step: int | None = None) -> Iterator[dict[str, torch.Tensor]]:
        """Endless training batches from the cursor. ``start_step=k`` first moves the cursor to batch k of a
        fresh run (k * batch_size samples from the start); None continues from where it is (the default,
        and what resuming through ``load_state_dict`` needs). The cursor moves before each yield."""
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1; got {batch_size}")
        if start_step is not None:
            self.epoch, self.position = divmod(start_step * batch_size, self.num_samples)
        while True:
            picked = []
            while len(picked) < batch_size:
                take = min(batch_size - len(picked), self.num_samples - self.position)
                picked.extend(self.order(self.epoch)[self.position: self.position + take].tolist())
                self.position += take
                if self.position == self.num_samples:
                    self.epoch, self.position = self.epoch + 1, 0
            yield self.collate(picked)

    def eval_batches(self, batch_size: int) -> Iterator[dict[str, torch.Tensor]]:
        """One pass in stream order (the last batch may be smaller), leaving the training cursor alone."""
        for lo in range(0, self.num_samples, batch_size):
            yield self.collate(range(lo, min(lo + batch_size, self.num_samples)))

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position, "shuffle_seed": self.shuffle_seed,
                "num_samples": self.num_samples, "seq_len": self.seq_len}

    def load_state_dict(self, state: dict) -> None:
        for key in ("num_samples", "seq_len"):
            if state[key] != getattr(self, key):
                raise ValueError(f"cannot resume: the saved state has {key}={state[key]} but this dataset has "
                                 f"{getattr(self, key)}; rebuild it from the same documents, tokenizer and seq_len")
        if not 0 <= state["position"] < self.num_samples:
            raise ValueError(f"saved position {state['position']} is outside [0, {self.num_samples})")
        self.epoch, self.position, self.shuffle_seed = state["epoch"], state["position"], state["shuffle_seed"]
        self._order_epoch = None
