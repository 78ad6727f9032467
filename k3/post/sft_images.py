"""Images in SFT data (SPEC §9's cold start, §10): chat messages with image parts -> the token stream ``k3 serve``
builds for them, packed with the images' features spliced in, trained in a K3ForConditionalGeneration.

Legend: N stream tokens, K images, T seq_len, n an image's placeholder tokens, P patches.

- Prompts (``ImagePrompt``): rendered by ``k3.vision.encode_chat`` with the chat format's template, tokenizer and the
  reasoning effort as ``ChatFormat`` puts it, the call ``k3.serve.images.chat_prompt`` makes for a request: a prompt
  trains on exactly the ids the server builds for the same messages (each image's placeholder run in place).
- Images are read once to check them (an error names the JSONL line and the part) and kept as their source (the
  ``data:`` URL's bytes, or the file) with their grid and digest (``ImageRef``); a batch decodes its images again
  (re-reading a file checks its digest), so memory holds compressed images, not pixels.
- Packing (``ImagePackedDataset``): the text stream is packed as ``PackedDataset`` packs it (documents back to back,
  cut into samples of T tokens, samples of a batch in one row); every image's run has its place in the stream, and a
  batch carries ``"media"``: the pixels of every image whose run overlaps its samples (each image whole through the
  tower, attention within each image: ``MoonViT``'s varlen attention), their grids, and ``image_tokens``, which of
  the images' tokens the row's placeholders take, in order (a sample cut inside a run holds part of it).
- The model (``build_model``): resumed from the run's checkpoint, a multimodal ``--init-from`` (its tower), or a text
  model (``--init-from`` or new) given a new tower and projector of the ``--vision`` preset; saved in the release's
  multimodal layout (``language_model.`` beside ``vision_tower.`` and ``mm_projector.``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from ..pretrained import load_pretrained
from ..config import K3Config
from ..data import PackedDataset
from ..train.state import load_checkpoint
from ..vision import ImageError, K3ForConditionalGeneration, VisionConfig, load_image, tokens_per_image
from ..vision.preprocess import ImageInput
from ..vision.chat import encode_chat, has_images, image_source, is_image_part
from ..vision.config import placeholder_of, vision_of

__all__ = ["ImageRef", "ImagePrompt", "ImagePackedDataset", "run_vision"]


@dataclass(frozen=True)
class ImageRef:
    """One image of the data: its ``source`` (bytes or a file), ``name`` in errors (``chat.jsonl:3:
    messages[0].content[1]``), ``grid`` (h, w) in patches and ``digest`` (k3.vision.preprocess)."""

    source: bytes | Path
    name: str
    grid: tuple[int, int]
    digest: bytes

    def pixels(self, vision: VisionConfig) -> torch.Tensor:
        """[h*w, 3, p, p]: decoded and preprocessed again, exactly as when it was read."""
        im = load_image(self.source, vision, name=self.name)
        if im.digest != self.digest:
            raise ImageError(f"{self.name}: the file {self.source} changed while k3 sft was running; rerun the "
                             "command (resuming from its checkpoint)")
        return im.pixels


class ImagePrompt:
    """Prompt ids of chat messages with images, as the server builds them, for ``vision`` and the placeholder id."""

    def __init__(self, vision: VisionConfig, placeholder_id: int):
        self.vision, self.placeholder_id = vision, placeholder_id

    def read(self, messages: Sequence[Mapping], where: str) -> tuple[list[ImageRef], dict[int, ImageInput]]:
        """Every image part of ``messages``, in order, read and checked (``where``: the JSONL line, in errors): their
        refs, and the images read by ``id()`` of their part, for ``ids`` to reuse while ``messages`` lives."""
        refs, loaded = [], {}
        for i, m in enumerate(messages):
            parts = m.get("content") if isinstance(m.get("content"), list) else []
            for j, part in enumerate(parts):
                if not is_image_part(part):
                    continue
                name = f"{where}: messages[{i}].content[{j}]"
                source = image_source(part, name)
                if isinstance(source, Path):
                    name += f" ({source})"
                im = load_image(source, self.vision, name=name)
                refs.append(ImageRef(source, name, im.grid, im.digest))
                loaded[id(part)] = im
        return refs, loaded

    def ids(self, fmt, messages: Sequence[Mapping], effort: str | None, where: str,
            loaded: Mapping[int, ImageInput]) -> tuple[list[int], list[int]]:
        """(prompt ids, where each image's placeholder run starts): ``fmt.prompt_ids`` with images in place, the
        images being ``read``'s (not decoded again for every assistant turn)."""
        msgs, reasoning_effort = fmt.messages(messages, effort)
        if not has_images(msgs):
            return fmt.prompt_ids(messages, effort), []
        try:
            out = encode_chat(fmt.template, fmt.tokenizer, msgs, self.vision, self.placeholder_id,
                              reasoning_effort=reasoning_effort, loaded=loaded)
        except ValueError as e:  # text that holds the placeholder token itself
            raise ValueError(f"{where}: {e}") from None
        return out.ids, out.starts


class ImagePackedDataset(PackedDataset):
    """``PackedDataset`` of chat documents with images (see the module docstring): ``docs`` are
    ``k3.post.sft_data.ChatDocument``s, each with its images and where their runs start."""

    def __init__(self, docs: Sequence, seq_len: int, eos_id: int, vision: VisionConfig, shuffle_seed: int | None = 0,
                 drop_last: bool = True):
        super().__init__([d.ids for d in docs], seq_len, eos_id, shuffle_seed, drop_last,
                         label_docs=[d.labels for d in docs])
        self.vision = vision
        kept = [d for d in docs if d.ids]  # as pack_stream: doc_starts[i] is kept document i's
        self.images: list[ImageRef] = [im for d in kept for im in d.images]
        starts = [int(s0) + s for d, s0 in zip(kept, self.doc_starts.tolist()) for s in d.starts]
        self.run_start = torch.tensor(starts, dtype=torch.int64)  # [K] each image's first placeholder in the stream
        self.run_len = torch.tensor([tokens_per_image(im.grid, vision) for im in self.images], dtype=torch.int64)  # [K]
        self.run_end = self.run_start + self.run_len  # runs are disjoint and in order: starts and ends both sorted

    def media(self, indices: Sequence[int]) -> dict:
        """{"pixels" [P,3,p,p] or None, "grids", "image_tokens" [n]} of the samples ``indices`` in one row."""
        pixels, grids, taken, offset = [], [], [], 0
        for i in indices:
            w = int(self._window[int(i)])
            lo, hi = w * self.seq_len, min((w + 1) * self.seq_len, len(self.tokens))
            first = int(torch.searchsorted(self.run_end, lo, right=True))  # the first run ending after lo
            last = int(torch.searchsorted(self.run_start, hi))  # runs starting before hi
            for k in range(first, last):
                s, n = int(self.run_start[k]), int(self.run_len[k])
                taken.append(torch.arange(max(s, lo) - s, min(s + n, hi) - s) + offset)
                offset += n
                pixels.append(self.images[k].pixels(self.vision))
                grids.append(self.images[k].grid)
        return {"pixels": torch.cat(pixels) if pixels else None, "grids": grids,
                "image_tokens": torch.cat(taken) if taken else torch.zeros(0, dtype=torch.int64)}

    def collate(self, indices: Sequence[int]) -> dict:
        return {**super().collate(indices), "media": self.media(indices)}


def run_vision(cfg, source: Path | None, resuming: bool) -> tuple[VisionConfig | None, int | None]:
    """(the run's vision config, the checkpoint's placeholder id or None): ``source``'s (the run's checkpoint or
    ``--init-from``), or a new tower's (``cfg.vision``, a preset name); (None, None) for a text model."""
    top = K3Config.from_hf(source).top_level if source is not None else None
    vision = vision_of(top)
    if vision is not None and cfg.vision and not resuming:
        raise ValueError(f"--vision {cfg.vision}: --init-from {cfg.init_from} already has a vision tower (its "
                         "config.json has a vision_config); drop --vision to fine-tune the tower it has")
    if vision is not None:
        return vision, placeholder_of(top)
    return (VisionConfig.preset(cfg.vision), None) if cfg.vision else (None, None)


def build_model(vision: VisionConfig, placeholder_id: int, mcfg: K3Config, device, resume_from: Path | None,
                init_dir: Path | None):
    """``k3.train.data.RunData.build_model`` for a multimodal run (see the module docstring)."""
    if resume_from is not None:
        saved = K3Config.from_hf(resume_from).top_level  # the run's tower, as it was saved
        model, state = load_checkpoint(resume_from, mcfg.replace(top_level=saved), verify=False, vision=True)
        return model.to(device), state
    if vision_of(mcfg.top_level) is not None:  # --init-from a multimodal checkpoint
        return load_pretrained(init_dir, config=mcfg, dtype=torch.float32, vision=True).to(device), None
    lm = load_pretrained(init_dir, config=mcfg, dtype=torch.float32) if init_dir is not None else None
    return K3ForConditionalGeneration(mcfg, vision, placeholder_id, language_model=lm).to(device), None
