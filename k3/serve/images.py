"""Chat prompts with images for the engine (SPEC §7, §10): what ``k3 serve`` and ``k3 chat`` send when a message holds
image parts. ``chat_prompt`` renders the messages in the chat format (k3.vision.encode_chat for images, the format's
own ``prompt`` for text) and turns each image into the engine's ``PromptImage`` (its placeholder run, pixels, grid
and digest: the prefix cache hashes the digest with the tokens)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from ..inference.api import PromptImage
from ..vision.chat import encode_chat, has_images
from ..vision.preprocess import MAX_PATCHES

__all__ = ["chat_prompt", "vision_of", "NoVisionTower"]

log = logging.getLogger("k3.serve")


class NoVisionTower(ValueError):
    """Images sent to a model without a vision tower."""


def vision_of(engine: Any) -> tuple | None:
    """(vision_config, media placeholder token id) of the engine's model, or None without a vision tower: a serving
    backend says it as ``vision``, an engine through its ``model``."""
    if hasattr(engine, "vision"):
        return engine.vision
    model = getattr(engine, "model", None)
    vc = getattr(model, "vision_config", None)
    return None if vc is None else (vc, model.media_placeholder_token_id)


def chat_prompt(engine: Any, template: Any, messages: list[dict], tools=None, tool_choice=None,
                reasoning_effort=None, base_dir: str | Path | None = None) -> tuple[list[int], Any, tuple]:
    """(prompt ids, the reply parser, PromptImages) for ``messages``; ``engine`` gives the tokenizer and
    ``vision_of(engine)``. Raises ``NoVisionTower`` when they hold images and the engine's model has none,
    ``k3.vision.ImageError`` for a bad image (``param`` names the part), and the format's ``ChatError``."""
    if not has_images(messages):
        prompt = template.prompt(engine.tokenizer, messages, tools, tool_choice, reasoning_effort)
        return prompt.ids, prompt.parser, ()
    info = vision_of(engine)
    if info is None:
        raise NoVisionTower("this model has no vision tower, so it cannot read images; send text only, or serve a "
                            "multimodal checkpoint (one whose config.json has a vision_config)")
    vision, placeholder = info
    out = encode_chat(template, engine.tokenizer, messages, vision, placeholder, tools=tools,
                      tool_choice=tool_choice, reasoning_effort=reasoning_effort, base_dir=base_dir)
    for k, im in enumerate(out.images):  # shrinking is the processor's rule (K2.5's too), said, never silent
        if im.resized_from is not None:
            H, W = im.resized_from
            log.warning("image %d of the request: %d x %d pixels shrunk to fit %d x %d patches (the tower's budget of "
                     "%d patches)", k, W, H, im.grid[1], im.grid[0], MAX_PATCHES)
    images = tuple(PromptImage(s, im.tokens(vision), im.pixels, im.grid, im.digest)
                   for s, im in zip(out.starts, out.images))
    return out.ids, out.parser, images
