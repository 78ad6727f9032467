"""SFT data (SPEC §9, the cold start): chat JSONL -> token documents with the loss on the assistant's tokens only.

Each line of the file is one conversation:

    {"messages": [{"role": "user", "content": "What is 1 2 + 3 4?"},
                  {"role": "assistant", "content": "4 6", "reasoning_content": "2+4+0 = 6\n1+3+0 = 4"}],
     "effort": "max", "id": "optional stable id"}

``messages`` as the OpenAI API writes them (``reasoning_content`` optional); ``effort`` (optional: low, high,
max) puts the reasoning effort in the prompt (k3.post.format). A message's ``content`` may be a list of parts, as
OpenAI's chat API and ``k3 serve`` take them: ``{"type": "text", "text": ...}``, and in the prompt's messages (not
the assistant's) images, ``{"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}}`` or
``{"type": "image", "path": "cat.png"}`` (relative to the JSONL file); such data trains a model with a vision tower
(k3.post.sft_images). Every assistant turn is a target: its tokens are
``ChatFormat.completion_ids`` after the prompt ``ChatFormat.prompt_ids`` of the turns before it, exactly the
tokens the engine is given and writes at inference. Turns whose prompt continues the previous turn's tokens
share one document; otherwise (a template that re-renders the history differently) the turn starts a new
document with its whole prompt. Labels are -100 on prompt tokens.

``prepare(cfg, run, resume_from, plan)`` is ``k3.train.loop.train``'s data step for ``k3 sft``: the split is by
conversation (a stable hash of its id: the line number unless given), the tokenizer is the ``--init-from``
checkpoint's (its chat format is the one trained), or a new byte-level BPE learned from the rendered
conversations when training from scratch (with ``<|media_pad|>``, the image placeholder, for a multimodal model).
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import NamedTuple

from ..chat import ChatTemplate
from ..data import Document, PackedDataset, eos_id, load_tokenizer, save_tokenizer, split_documents, train_tokenizer
from ..data.corpus import jsonl_objects
from ..data.tokenizer import EOS, unigram_entropy
from ..train import data as run_data
from ..train.data import RunData
from ..vision.chat import has_images, is_image_part
from ..vision.prompt import MEDIA_PAD
from . import sft_images
from .format import ChatFormat
from .tasks.base import EFFORTS

__all__ = ["Conversation", "ChatDocument", "load_conversations", "encode_conversation", "prepare"]

ROLES = ("system", "developer", "user", "assistant", "tool")


class Conversation(Document):
    """A Document whose text is the JSON of its messages (``messages``, ``effort``, ``where``: its file:line)."""

    @property
    def messages(self) -> list[dict]:
        return json.loads(self.text)["messages"]

    @property
    def effort(self) -> str | None:
        return json.loads(self.text).get("effort")

    @property
    def where(self) -> str:
        return json.loads(self.text)["where"]


class ChatDocument(NamedTuple):
    """One training document: ``ids``, ``labels`` (-100 but on the assistant's tokens), and the images whose
    placeholder runs it holds (``k3.post.sft_images.ImageRef``) with where each run starts in ``ids``."""

    ids: list[int]
    labels: list[int]
    images: tuple = ()
    starts: tuple[int, ...] = ()


def _check(obj, where: str) -> None:
    def bad(what: str):
        raise ValueError(f"{where}: {what}; each line must be an object like "
                         '{"messages": [{"role": "user", "content": "..."}, {"role": "assistant", "content": "..."}]}')

    if not isinstance(obj, dict) or not isinstance(obj.get("messages"), list) or not obj["messages"]:
        bad("no non-empty \"messages\" list")
    for i, m in enumerate(obj["messages"]):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            bad(f"messages[{i}] needs a \"role\" among {list(ROLES)}")
        if m.get("reasoning_content") is not None and not isinstance(m["reasoning_content"], str):
            bad(f"messages[{i}].reasoning_content must be a string")
        if isinstance(m.get("content"), list):
            for j, part in enumerate(m["content"]):
                if is_image_part(part) and m["role"] == "assistant":
                    bad(f"messages[{i}].content[{j}] is an image in an assistant message: the assistant's tokens "
                        "are the training targets and k3 writes text only; put images in the user's messages")
                if not is_image_part(part) and not (isinstance(part, dict) and part.get("type") == "text"
                                                    and isinstance(part.get("text"), str)):
                    bad(f"messages[{i}].content[{j}] must be {{\"type\": \"text\", \"text\": ...}}, {{\"type\": "
                        "\"image_url\", \"image_url\": {\"url\": \"data:image/png;base64,...\"}} or {\"type\": "
                        "\"image\", \"path\": ...}")
        elif m.get("content") is not None and not isinstance(m["content"], str):
            bad(f"messages[{i}].content must be a string or a list of content parts")
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
        messages = [_content(m, path.parent) for m in obj["messages"]]
        out.append(Conversation(obj.get("id") or f"{path.name}:{lineno}",
                                json.dumps({"messages": messages, "effort": obj.get("effort"), "where": where})))
    if len(out) < 2:
        raise ValueError(f"{path} holds {len(out)} conversation(s); SFT needs at least 2 (one is held out for "
                         "the validation loss)")
    return out


def _content(m: dict, base_dir: Path) -> dict:
    """The message with text-only content as one string, and image files' paths relative to ``base_dir`` made
    absolute (every chat format renders a string; an image part stays a part)."""
    content = m.get("content")
    if not isinstance(content, list):
        return m
    if not any(is_image_part(p) for p in content):
        return {**m, "content": "".join(p["text"] for p in content)}
    return {**m, "content": [{**p, "path": str(base_dir / Path(p["path"]).expanduser())}
                             if p.get("type") == "image" and isinstance(p.get("path"), str) and p["path"] else p
                             for p in content]}


def _text(content) -> str:
    return "".join(p["text"] for p in content if p.get("type") == "text") if isinstance(content, list) else \
        content or ""


def encode_conversation(fmt: ChatFormat, messages: list[dict], effort: str | None = None,
                        images: sft_images.ImagePrompt | None = None, where: str = "the conversation"
                        ) -> list[ChatDocument]:
    """-> one or more ChatDocuments; labels -100 except on the assistant turns' tokens. ``images``: how prompts
    with images are built (a model with a vision tower); ``where`` names the conversation in image errors."""
    refs, loaded = images.read(messages, where) if images is not None else ([], {})
    docs: list[ChatDocument] = []
    ids: list[int] = []
    labels: list[int] = []
    last: tuple[tuple, tuple] = ((), ())  # the images of the document so far and where their runs start
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        if not i:
            raise ValueError("a conversation cannot start with an assistant message: give the user's turn first")
        if refs:
            prompt, starts = images.ids(fmt, messages[:i], effort, where, loaded)
        else:
            prompt, starts = fmt.prompt_ids(messages[:i], effort), []
        target = fmt.completion_ids(m, effort)
        if ids and prompt[:len(ids)] != ids:  # the history re-renders differently: a new document
            docs.append(ChatDocument(ids, labels, *last))
            ids, labels = [], []
        ids, labels = ids + prompt[len(ids):], labels + [-100] * (len(prompt) - len(ids))
        ids, labels = ids + target, labels + target
        last = (tuple(refs[:len(starts)]), tuple(starts))  # this prompt holds the first len(starts) images
    docs.append(ChatDocument(ids, labels, *last))
    return docs


def _encode(fmt: ChatFormat, convs: list[Conversation], images) -> list[ChatDocument]:
    return [d for c in convs for d in encode_conversation(fmt, c.messages, c.effort, images, c.where)]


def _tokenizer(cfg, train_convs, run: Path, resume_from: Path | None, multimodal: bool):
    source = resume_from or run_data.init_dir(cfg)
    if source is not None:
        tok = load_tokenizer(source / "tokenizer.json")
        if not (run / "tokenizer.json").exists():
            save_tokenizer(tok, run / "tokenizer.json")
        return tok
    # a new tokenizer has no special tokens: its format is ChatML
    texts = [ChatTemplate().render([{"role": m["role"], "content": (m.get("reasoning_content") or "") +
                                     _text(m.get("content"))} for m in c.messages]) for c in train_convs]
    tok = train_tokenizer(texts, cfg.vocab_size, special_tokens=(EOS, MEDIA_PAD) if multimodal else (EOS,))
    save_tokenizer(tok, run / "tokenizer.json")
    return tok


def _vision(cfg, convs, resume_from: Path | None, par):
    """(VisionConfig, placeholder id or None) of a multimodal run, (None, None) for a text one; image data without
    a vision tower, or a multimodal run over several processes, is refused here."""
    vision, placeholder = sft_images.run_vision(cfg, resume_from or run_data.init_dir(cfg), resume_from is not None)
    first = next((c for c in convs if has_images(c.messages)), None)
    if vision is None and first is not None:
        raise ValueError(f"{first.where}: the data has images but the model has no vision tower"
                         + (f" (--init-from {cfg.init_from} is a text model)" if cfg.init_from else "")
                         + "; add --vision tiny (or moonvit-v2, k25-moonvit) to give it a new MoonViT tower and "
                         "projector, trained from scratch with the model, or --init-from a multimodal checkpoint "
                         "(config.json with a vision_config)")
    if vision is not None and par.world > 1:
        raise ValueError("k3 sft with a vision tower runs in one process for now; run it without torchrun and with "
                         "--dp/--cp/--ep 1")
    return vision, placeholder


def prepare(cfg, run: Path, resume_from: Path | None, par) -> RunData:
    """``k3 sft``'s data step (see the module docstring): rank 0 reads or learns the tokenizer; every rank then
    builds the same packed datasets, with labels."""
    if cfg.data is None:
        raise ValueError("k3 sft needs --data: a JSONL file of {\"messages\": [...]} lines (k3 demo-post writes "
                         "one from the embedded tasks)")
    convs = load_conversations(cfg.data)
    vision, placeholder = _vision(cfg, convs, resume_from, par)
    train_convs, val_convs = split_documents(convs, cfg.val_fraction, cfg.seed)
    tok = _tokenizer(cfg, train_convs, run, resume_from, vision is not None) if par.rank == 0 else None
    par.barrier()
    if tok is None:
        tok = load_tokenizer((resume_from or run) / "tokenizer.json")
    fmt, eos = ChatFormat(tok), eos_id(tok)
    if vision is None:
        train_docs, val_docs = _encode(fmt, train_convs, None), _encode(fmt, val_convs, None)
        train_set = PackedDataset([d.ids for d in train_docs], cfg.seq_len, eos, shuffle_seed=cfg.seed,
                                  label_docs=[d.labels for d in train_docs])
        val_set = PackedDataset([d.ids for d in val_docs], cfg.seq_len, eos, shuffle_seed=None, drop_last=False,
                                label_docs=[d.labels for d in val_docs])
        build = None
    else:
        if placeholder is None:
            placeholder = _placeholder(tok, cfg)
        images = sft_images.ImagePrompt(vision, placeholder)
        train_docs, val_docs = _encode(fmt, train_convs, images), _encode(fmt, val_convs, images)
        train_set = sft_images.ImagePackedDataset(train_docs, cfg.seq_len, eos, vision, shuffle_seed=cfg.seed)
        val_set = sft_images.ImagePackedDataset(val_docs, cfg.seq_len, eos, vision, shuffle_seed=None,
                                                drop_last=False)
        build = functools.partial(sft_images.build_model, vision, placeholder)
    targets = val_set.tokens[val_set.labels != -100]
    return RunData(tok, train_set, val_set, unigram_entropy(targets), build_model=build)


def _placeholder(tok, cfg) -> int:
    """The id of the tokenizer's image placeholder token, for a new tower (``--vision``)."""
    pid = tok.token_to_id(MEDIA_PAD)
    if pid is None:
        raise ValueError(f"--vision {cfg.vision}: the tokenizer of --init-from {cfg.init_from} has no {MEDIA_PAD} "
                         "token to stand for image tokens; fine-tune a checkpoint whose tokenizer has one (the K2.5 "
                         "and K3 tokenizers do, and so does the one k3 sft learns for a new multimodal model)")
    return pid
