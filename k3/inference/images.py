"""Image features for the prefill (SPEC §7, §10): computed in bounded pieces between steps, kept until used.

Legend: D the LM's width, T a prefill's packed tokens.

A prompt's image is encoded before any of its placeholder tokens is scheduled: ``encode`` advances the images that
the scheduler names (``Scheduler.images_to_encode``) by about a FLOP budget per step, through the model's
``encode_image_pieces`` (k3.vision.stepwise: the vision tower and projector in pieces), so a 16384-patch image
never holds a step for the whole tower while other sequences decode. ``ready`` tells the scheduler which images may
be prefilled; their features [length, D] stay until the image's last placeholder is prefilled (a chunk boundary or a
prefix-cache hit may fall inside an image), or until the sequence ends (``release``).
"""

from __future__ import annotations

import torch

from .api import PromptImage
from .scheduler import PrefillItem

__all__ = ["ImageFeatures"]


class ImageFeatures:
    def __init__(self, model, device):
        self.model, self.device = model, device
        self.features: dict[tuple[str, int], torch.Tensor] = {}  # (sequence, image start) -> [length, D]
        self.jobs: dict[tuple[str, int], object] = {}  # images being encoded: their piece generators

    def ready(self, seq_id: str, im: PromptImage) -> bool:
        """The image's features are computed: its placeholders may be prefilled."""
        return (seq_id, im.start) in self.features

    def encode(self, wanted: list[tuple[str, PromptImage]], budget: float) -> float:
        """Advance the encoding of the ``wanted`` images (sequence id, image), in order, by about ``budget`` FLOPs:
        pieces of a quarter of it, until the budget is spent (at least one piece). Returns the FLOPs spent."""
        spent = 0.0
        for seq_id, im in wanted:
            key = (seq_id, im.start)
            if key in self.features:
                continue
            job = self.jobs.get(key)
            if job is None:
                job = self.jobs[key] = self.model.encode_image_pieces(im.pixels.to(self.device), im.grid, budget / 4)
            while spent < budget:
                try:
                    spent += next(job)
                except StopIteration as done:
                    del self.jobs[key]
                    if done.value.shape[0] != im.length:
                        raise ValueError(f"an image of {im.grid} patches gives {done.value.shape[0]} tokens but its "
                                         f"request reserved {im.length} placeholders") from None
                    self.features[key] = done.value
                    break
            if spent >= budget:
                break
        return spent

    def embed(self, x: torch.Tensor, items: list[PrefillItem], cu: list[int]) -> torch.Tensor:
        """x [1,T,D], the packed chunks' token embeddings -> the same with image features at their placeholders."""
        for it, off in zip(items, cu):
            end = it.start + len(it.tokens)
            for im in it.images:
                key = (it.seq_id, im.start)
                feats = self.features.get(key)
                if feats is None:
                    raise RuntimeError(f"sequence {it.seq_id}: the image at token {im.start} was scheduled before "
                                       "its features were encoded (the scheduler must wait for ready)")
                lo, hi = max(im.start, it.start), min(im.start + im.length, end)
                x[0, off + lo - it.start: off + hi - it.start] = feats[lo - im.start: hi - im.start].to(x.dtype)
                if hi == im.start + im.length:  # its last placeholder is done
                    del self.features[key]
        return x

    def release(self, seq_id: str) -> None:
        """Forget what is kept for a finished sequence (an image it did not finish prefilling, or encoding)."""
        for table in (self.features, self.jobs):
            for key in [k for k in table if k[0] == seq_id]:
                del table[key]
