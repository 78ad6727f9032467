"""Chat messages with images -> the prompt's token ids (each image's placeholder run in place) and the preprocessed
images (SPEC §10: image tokens replace a media placeholder in the text stream). What ``k3 chat --image``, ``k3 serve``
(OpenAI ``image_url`` parts) and SFT data with images share.

A message's ``content`` is a string or a list of parts, OpenAI's and one of k3's own:

    {"type": "text", "text": "What is in the picture?"}
    {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0..."}}   # OpenAI's
    {"type": "image", "path": "cat.png"}                                             # a file (relative: base_dir)

k3 runs offline: an ``http(s)://`` URL is refused with an error saying to send the bytes as a ``data:`` URL.

How: each image part becomes a sentinel string in the message's text; the chat format (any of k3.chat's,
passed in as ``template``) renders the messages as it renders text, through a tokenizer that encodes the sentinel
as one ``IMAGE_SLOT``; ``expand_image_slots`` then puts each image's block (its h*w/4 placeholders, in the Kimi
tokenizers' media markers) in place of its slot. So an image sits exactly where its part was, in every format, and
text around it is tokenized as the format tokenizes text (user text cannot forge markup or placeholders: a prompt
whose text holds the placeholder token itself is refused).
"""

from __future__ import annotations

import base64
import binascii
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .config import VisionConfig
from .preprocess import MAX_PATCHES, MAX_PIXELS, ImageError, ImageInput, load_image, pack_images
from .prompt import IMAGE_SLOT, expand_image_slots

__all__ = ["ChatImages", "encode_chat", "has_images", "is_image_part", "image_source", "data_url"]


@dataclass
class ChatImages:
    """``ids``: the prompt with each image's placeholder run; ``images``: the preprocessed images in prompt order;
    ``starts``: where each image's run begins in ``ids``; ``parser``: the chat format's reply parser."""

    ids: list[int]
    images: list[ImageInput]
    starts: list[int]
    parser: Any = None

    def packed(self) -> tuple[torch.Tensor | None, list[tuple[int, int]]]:
        """(pixels [patches,3,p,p], grids): the images as ``K3ForConditionalGeneration.forward`` takes them."""
        return pack_images(self.images)


def has_images(messages: Sequence[Mapping]) -> bool:
    return any(isinstance(m.get("content"), list) and any(is_image_part(p) for p in m["content"]) for m in messages)


def is_image_part(part: Any) -> bool:
    return isinstance(part, Mapping) and part.get("type") in ("image_url", "image")


def data_url(data: bytes, mime: str = "image/png") -> str:
    """Image bytes as a ``data:`` URL (what an OpenAI client sends for a local image)."""
    return f"data:{mime};base64,{base64.b64encode(data).decode('ascii')}"


def _decode_data_url(url: str, where: str) -> bytes:
    head, sep, body = url.partition(",")
    if not sep or not head.endswith(";base64"):
        raise ImageError(f"{where}: a data: URL must be base64 (data:image/png;base64,...); got {url[:40]!r}...", where)
    try:
        return base64.b64decode(body, validate=True)
    except (binascii.Error, ValueError) as e:
        raise ImageError(f"{where}: the data: URL's base64 is invalid ({e}); encode the image's bytes with standard "
                         "base64", where) from None


def image_source(part: Mapping, where: str, base_dir: str | Path | None = None) -> bytes | Path:
    """The bytes (or the file) an image part names; ``where`` names the part in errors (``messages[0].content[1]``)."""
    if part.get("type") == "image":
        path = part.get("path")
        if not isinstance(path, str) or not path:
            raise ImageError(f"{where}: an image part needs a \"path\" (a file name), as {{\"type\": \"image\", "
                             "\"path\": \"cat.png\"}", where)
        p = Path(path).expanduser()
        return p if p.is_absolute() or base_dir is None else Path(base_dir) / p
    spec = part.get("image_url")
    url = spec.get("url") if isinstance(spec, Mapping) else None
    if not isinstance(url, str):
        raise ImageError(f"{where}: an image_url part needs {{\"image_url\": {{\"url\": \"data:image/png;base64,..."
                         "\"}}", where)
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme in ("http", "https"):
        raise ImageError(f"{where}.image_url.url: k3 does not fetch URLs (it runs offline, with no network access); "
                         "send the image itself as a data: URL (data:image/png;base64,...)", f"{where}.image_url.url")
    if scheme != "data":
        raise ImageError(f"{where}.image_url.url: expected a data: URL (data:image/png;base64,...); got "
                         f"{url[:40]!r}", f"{where}.image_url.url")
    return _decode_data_url(url, f"{where}.image_url.url")


def _describe(part: Mapping) -> str:
    """An image part in a few words, for errors: its file, or its URL's scheme and media type (never its bytes)."""
    if part.get("type") == "image":
        return f"the file {part.get('path')!r}"
    url = str((part.get("image_url") or {}).get("url", ""))
    head = url.split(",", 1)[0][:60]
    return f"a {head} URL" if head.startswith("data:") else "an image_url"


class _SlotTokenizer:
    """The tokenizer, encoding ``sentinel`` in any text as one ``IMAGE_SLOT`` (other attributes pass through)."""

    def __init__(self, tokenizer, sentinel: str):
        self._tok, self._sentinel = tokenizer, sentinel

    def __getattr__(self, name):
        attr = getattr(self._tok, name)
        if name == "encode_text":  # K3's format encodes message text with it (no markup inside text)
            return lambda text: self._split(text, attr)
        return attr

    def encode(self, text: str, add_special_tokens: bool = False):
        ids = self._split(text, lambda t: self._tok.encode(t, add_special_tokens=add_special_tokens).ids)
        return _Encoding(ids)

    def _split(self, text: str, encode) -> list[int]:
        ids: list[int] = []
        for k, piece in enumerate(text.split(self._sentinel)):
            if k:
                ids.append(IMAGE_SLOT)
            if piece:
                ids += list(encode(piece))
        return ids


@dataclass
class _Encoding:
    ids: list[int]


def encode_chat(template, tokenizer, messages: Sequence[Mapping], vision: VisionConfig, placeholder_id: int, *,
                tools=None, tool_choice=None, reasoning_effort=None, base_dir: str | Path | None = None,
                max_pixels: int = MAX_PIXELS, max_patches: int = MAX_PATCHES,
                loaded: Mapping[int, ImageInput] | None = None) -> ChatImages:
    """``messages`` (content as a string or parts, above) -> ChatImages, rendered by ``template`` (a chat format of
    k3.chat: ``template.prompt(tokenizer, messages, tools, tool_choice, reasoning_effort)``). Image errors are
    ``ImageError``s naming the part (``param``); ``max_pixels`` / ``max_patches`` as ``k3.vision.load_image``.
    ``loaded``: images already read, by ``id()`` of their part (the caller keeps the parts alive), used instead of
    reading them again."""
    sentinel = f"\ue000k3-image-{secrets.token_hex(8)}\ue000"  # a fresh one per call: no text can hold it
    images: list[ImageInput] = []
    flat = []
    for i, m in enumerate(messages):
        content = m.get("content")
        if not isinstance(content, list):
            flat.append(dict(m))
            continue
        text = []
        for j, part in enumerate(content):
            where = f"messages[{i}].content[{j}]"
            if is_image_part(part) and loaded is not None and id(part) in loaded:
                images.append(loaded[id(part)])
                text.append(sentinel)
            elif is_image_part(part):
                try:
                    images.append(load_image(image_source(part, where, base_dir), vision, max_pixels=max_pixels,
                                             max_patches=max_patches, name=f"{where} ({_describe(part)})"))
                except ImageError as e:
                    e.param = e.param or where
                    raise
                text.append(sentinel)
            elif isinstance(part, Mapping) and part.get("type") == "text" and isinstance(part.get("text"), str):
                text.append(part["text"])
            else:
                raise ValueError(f"{where}: a content part must be {{\"type\": \"text\", \"text\": ...}}, "
                                 "{\"type\": \"image_url\", \"image_url\": {\"url\": \"data:...\"}} or "
                                 f"{{\"type\": \"image\", \"path\": ...}}; got {str(part)[:60]}")
        flat.append({**m, "content": "".join(text)})
    prompt = template.prompt(_SlotTokenizer(tokenizer, sentinel), flat, tools, tool_choice, reasoning_effort)
    counts = [im.tokens(vision) for im in images]
    if sum(1 for t in prompt.ids if t == placeholder_id):
        raise ValueError(f"the messages' text holds the image placeholder token (id {placeholder_id}) itself; images "
                         "go in image parts, not as placeholder text")
    ids, starts = expand_image_slots(prompt.ids, counts, placeholder_id, tokenizer)
    return ChatImages(ids, images, starts, prompt.parser)
