"""The multimodal checkpoint layout (SPEC §1, §10): the text model's weights under ``language_model.`` beside the vision
tower (``vision_tower.``) and the projector (``mm_projector.``), as the K3 and K2.5 releases store them.

The vision tensors keep the release's names in k3's module tree (``K3ForConditionalGeneration``), so only aliases are
translated: ``multi_modal_projector.`` (SPEC's and Kimi-VL's name for the projector) is read as ``mm_projector.``,
and Kimi-VL's ``linear_1`` / ``linear_2`` as ``proj.0`` / ``proj.2``. The text tensors go through the text
model's own translation (io.py) with the prefix stripped, and back with it.
"""

from __future__ import annotations

import re

import torch

__all__ = ["TEXT_PREFIX", "VISION_PREFIXES", "is_vision", "split_text", "vision_state"]

TEXT_PREFIX = "language_model."
VISION_PREFIXES = ("vision_tower.", "vision_model.", "mm_projector.", "multi_modal_projector.")


def is_vision(name: str) -> bool:
    return name.startswith(VISION_PREFIXES)


def split_text(state: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]] | None:
    """A multimodal model's state dict -> (text model's state without the prefix, the vision tensors); None for a
    text-only state (nothing under ``language_model.``)."""
    if not any(k.startswith(TEXT_PREFIX) for k in state):
        return None
    text = {k[len(TEXT_PREFIX):]: v for k, v in state.items() if k.startswith(TEXT_PREFIX)}
    other = {k: v for k, v in state.items() if not k.startswith(TEXT_PREFIX)}
    odd = [k for k in other if not is_vision(k)]
    if odd:
        raise ValueError(f"tensors {odd[:5]} are neither under {TEXT_PREFIX!r} nor under a vision prefix "
                         f"{VISION_PREFIXES}: not a multimodal model's state")
    return text, other


def _our_vision_name(name: str) -> str:
    name = re.sub(r"^multi_modal_projector\.", "mm_projector.", name)
    if name.startswith("mm_projector."):
        name = re.sub(r"^mm_projector\.linear_([12])\.", lambda m: f"mm_projector.proj.{2 * int(m.group(1)) - 2}.",
                      name)
    return name


def vision_state(hf: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The checkpoint's vision tensors in k3's names, floats in ``dtype``."""
    out = {}
    for name, t in hf.items():
        if is_vision(name):
            ours = _our_vision_name(name)
            if ours in out:
                raise ValueError(f"{name} and another tensor both map to {ours}: the checkpoint holds the projector "
                                 "under two names")
            out[ours] = t.to(dtype) if t.is_floating_point() else t
    return out
