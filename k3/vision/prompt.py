"""Images in token streams: the slot a chat format leaves for each image -> the image's tokens (SPEC §10: image
tokens replace a media placeholder token in the text stream).

A chat format renders each image as one ``IMAGE_SLOT`` id (k3.chat); ``expand_image_slots`` replaces the i-th
slot by image i's block: its h*w/4 placeholder tokens (``media_placeholder_token_id``), wrapped, when the tokenizer
has Kimi's media tokens (the K2.5 and K3 tokenizers), as transformers' ``Kimi_K25Processor`` writes an image:
``<|media_begin|>image<|media_content|>`` + placeholders + ``<|media_end|>``. k3's own BPE has no media tokens:
the placeholders alone.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["IMAGE_SLOT", "MEDIA_PAD", "MEDIA_BEGIN", "MEDIA_CONTENT", "MEDIA_END", "expand_image_slots"]

IMAGE_SLOT = -1  # never a token id
MEDIA_PAD = "<|media_pad|>"  # the placeholder token of the Kimi tokenizers (and of k3 BPEs learned for images)
MEDIA_BEGIN, MEDIA_CONTENT, MEDIA_END = "<|media_begin|>", "<|media_content|>", "<|media_end|>"


def _media_block(tokenizer) -> tuple[list[int], list[int]]:
    """(ids before the placeholders, ids after) for this tokenizer."""
    ids = [tokenizer.token_to_id(t) for t in (MEDIA_BEGIN, MEDIA_CONTENT, MEDIA_END)] if tokenizer is not None \
        else [None]
    if any(i is None for i in ids):
        return [], []
    begin, content, end = ids
    return [begin, *tokenizer.encode("image", add_special_tokens=False).ids, content], [end]


def expand_image_slots(ids: Sequence[int], counts: Sequence[int], placeholder_id: int, tokenizer=None
                       ) -> tuple[list[int], list[int]]:
    """``ids`` with one ``IMAGE_SLOT`` per image -> (the ids with each slot replaced by its image's block, the start
    of each image's placeholder run). ``counts``: each image's number of placeholder tokens, in slot order."""
    slots = sum(1 for t in ids if t == IMAGE_SLOT)
    if slots != len(counts):
        raise ValueError(f"the prompt has {slots} image slot(s) but {len(counts)} image(s) were given: every image "
                         "needs its place in the text")
    before, after = _media_block(tokenizer)
    out, starts, k = [], [], 0
    for t in ids:
        if t != IMAGE_SLOT:
            out.append(t)
            continue
        out += before
        starts.append(len(out))
        out += [placeholder_id] * counts[k] + after
        k += 1
    return out, starts
