"""SFT data (SPEC §9, the cold start): chat JSONL -> token documents with the loss on the assistant's tokens only.

Each line of the file is one conversation:

    {"messages": [{"role": "user", "content": "What is 1 2 + 3 4?"},
                  {"role": "assistant", "content": "4 6", "reasoning_content": "2+4+0 = 6\n1+3+0 = 4"}],
     "effort": "max", "id": "optional stable id"}

``messages`` as the OpenAI API writes them (``reasoning_content`` optional); ``effort`` (optional: low, high,
max) puts the reasoning effort in the prompt (k3.post.format). Every assistant turn is a target: its tokens are
``ChatFormat.completion_ids`` after the prompt ``ChatFormat.prompt_ids`` of the turns before it, exactly the
tokens the engine is given and writes at inference. Turns whose prompt continues the previous turn's tokens
share one document; otherwise (a template that re-renders the history differently) the turn starts a new
document with its whole prompt. Labels are -100 on prompt tokens.

``prepare(cfg, run, resume_from, plan)`` is ``k3.train.loop.train``'s data step for ``k3 sft``: the split is by
conversation (a stable hash of its id: the line number unless given), the tokenizer is the ``--init-from``
checkpoint's (its chat format is the one trained), or a new byte-level BPE learned from the rendered
conversations when training from scratch.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..data import Document, PackedDataset, eos_id, load_tokenizer, save_tokenizer, split_documents, train_tokenizer
from ..data.corpus import jsonl_objects
from ..data.tokenizer import unigram_entropy
from ..train import data as run_data
from ..train.data import RunData
from .format import ChatFormat
from .tasks.base import EFFORTS

__all__ = ["Conversation", "load_conversations", "encode_conversation", "prepare"]

ROLES = ("system", "developer", "user", "assistant", "tool")


class Conversation(Document):
    """A Document whose text is the JSON of its messages (``messages``, ``effort``)."""

    @property
    def messages(self) -> list[dict]:
        return json.loads(self.text)["messages"]

    @property
    def effort(self) -> str | None:
        return json.loads(self.text).get("effort")


def _check(obj, where: str) -> None:
    def bad(what: str):
        raise ValueError(f"{where}: {what}; each line must be an object like "
                         '{"messages": [{"role": "user", "content": "..."}, {"role": "assistant", "content": "..."}]}')

    if not isinstance(obj, dict) or not isinstance(obj.get("messages"), list) or not obj["messages"]:
        bad("no non-empty \"messages\" list")
    for i, m in enumerate(obj["messages"]):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            bad(f"messages[{i}] needs a \"role\" among {list(ROLES)}")
        for key in ("content", "reasoning_content"):
            if m.get(key) is not None and not isinstance(m[key], str):
                bad(f"messages[{i}].{key} must be a string")
    if not any(m["role"] == "assistant" for m in obj["messages"]):
        bad("no assistant message: nothing to train on")
    if obj.get("effort") is not None and obj["effort"] not in EFFORTS:
        bad(f"\"effort\" must be one of {list(EFFORTS)} (or absent); got {obj['effort']!r}")
    if obj.get("id") is not None and not isinstance(obj["id"], str):
        bad("\"id\" must be a string")


def load_conversations(path: str | Path) -> list[Conversation]:
    """The conversations of a chat JSONL file, each checked (the error names the line and what is wrong)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"chat data {str(path)!r} is not a file; give a JSONL file of {{\"messages\": [...]}} "
                                "lines")
    out = []
    for lineno, where, obj in jsonl_objects(path, '{"messages": [...]}'):
        _check(obj, where)
        out.append(Conversation(obj.get("id") or f"{path.name}:{lineno}",
                                json.dumps({"messages": obj["messages"], "effort": obj.get("effort")})))
    if len(out) < 2:
        raise ValueError(f"{path} holds {len(out)} conversation(s); SFT needs at least 2 (one is held out for "
                         "the validation loss)")
    return out


def encode_conversation(fmt: ChatFormat, messages: list[dict], effort: str | None = None
                        ) -> list[tuple[list[int], list[int]]]:
    """-> [(ids, labels)], one or more documents; labels -100 except on the assistant turns' tokens."""
    docs: list[tuple[list[int], list[int]]] = []
    ids: list[int] = []
    labels: list[int] = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        prompt = fmt.prompt_ids(messages[:i], effort) if i else None
        if prompt is None:
            raise ValueError("a conversation cannot start with an assistant message: give the user's turn first")
        target = fmt.completion_ids(m, effort)
        if ids and prompt[:len(ids)] != ids:  # the history re-renders differently: a new document
            docs.append((ids, labels))
            ids, labels = [], []
        ids, labels = ids + prompt[len(ids):], labels + [-100] * (len(prompt) - len(ids))
        ids, labels = ids + target, labels + target
    docs.append((ids, labels))
    return docs


def _encode(fmt: ChatFormat, convs: list[Conversation]) -> tuple[list[list[int]], list[list[int]]]:
    docs = [d for c in convs for d in encode_conversation(fmt, c.messages, c.effort)]
    return [d[0] for d in docs], [d[1] for d in docs]


def _tokenizer(cfg, train_convs, run: Path, resume_from: Path | None):
    source = resume_from or run_data.init_dir(cfg)
    if source is not None:
        tok = load_tokenizer(source / "tokenizer.json")
        if not (run / "tokenizer.json").exists():
            save_tokenizer(tok, run / "tokenizer.json")
        return tok
    from ..serve.chat import ChatTemplate  # a new tokenizer has no special tokens: its format is ChatML

    texts = [ChatTemplate().render([{"role": m["role"], "content": (m.get("reasoning_content") or "") +
                                     (m.get("content") or "")} for m in c.messages]) for c in train_convs]
    tok = train_tokenizer(texts, cfg.vocab_size)
    save_tokenizer(tok, run / "tokenizer.json")
    return tok


def prepare(cfg, run: Path, resume_from: Path | None, par) -> RunData:
    """``k3 sft``'s data step (see the module docstring): rank 0 reads or learns the tokenizer; every rank then
    builds the same packed datasets, with labels."""
    if cfg.data is None:
        raise ValueError("k3 sft needs --data: a JSONL file of {\"messages\": [...]} lines (k3 demo-post writes "
                         "one from the embedded tasks)")
    train_convs, val_convs = split_documents(load_conversations(cfg.data), cfg.val_fraction, cfg.seed)
    tok = _tokenizer(cfg, train_convs, run, resume_from) if par.rank == 0 else None
    par.barrier()
    if tok is None:
        tok = load_tokenizer((resume_from or run) / "tokenizer.json")
    fmt = ChatFormat(tok)
    train_ids, train_labels = _encode(fmt, train_convs)
    val_ids, val_labels = _encode(fmt, val_convs)
    eos = eos_id(tok)
    train_set = PackedDataset(train_ids, cfg.seq_len, eos, shuffle_seed=cfg.seed, label_docs=train_labels)
    val_set = PackedDataset(val_ids, cfg.seq_len, eos, shuffle_seed=None, drop_last=False, label_docs=val_labels)
    targets = val_set.tokens[val_set.labels != -100]
    return RunData(tok, train_set, val_set, unigram_entropy(targets))
