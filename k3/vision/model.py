"""K3ForConditionalGeneration: the language model with the vision tower and the projector (SPEC §10).

Legend: B batch, T tokens, D the LM's width, n image tokens (merged patches), M merge area, Dv the tower's width.

Image tokens replace the media placeholder token in the text stream: each image of h x w patches gives h*w/M tokens
(``tokens_per_image``), the projector maps each merged 2 x 2 neighbourhood [M, Dv] to one [D] embedding, and those
embeddings take the places of the prompt's placeholder tokens, image after image (``embed``); a packed training
row that holds only part of an image's run (a sample cut inside it) says which of the images' tokens it holds
(``image_tokens``). The placeholder positions carry no next-token loss (``labels`` there are ignored).

Module names are the release's: ``language_model.`` (a K3ForCausalLM), ``vision_tower.``, ``mm_projector.``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from ..config import K3Config
from ..model.transformer import CausalLMOutput, K3ForCausalLM
from .config import VisionConfig, placeholder_of, vision_of
from .stepwise import encode_in_pieces
from .tower import MoonViT

__all__ = ["K3ForConditionalGeneration", "Projector", "tokens_per_image", "count_vision_parameters"]


def tokens_per_image(grid: tuple[int, int], cfg: VisionConfig) -> int:
    """How many placeholder tokens an image of ``grid`` = (h, w) patches takes in the prompt."""
    return grid[0] * grid[1] // cfg.merge


def count_vision_parameters(cfg: VisionConfig, text_hidden: int) -> dict[str, int]:
    """{"vision_tower": n, "mm_projector": n}: built on the meta device (no memory). MoonViT-V2 as released:
    401,214,464 + 46,144,512 into hidden 7168."""
    with torch.device("meta"):
        tower, projector = MoonViT(cfg), Projector(cfg, text_hidden)
    return {"vision_tower": sum(p.numel() for p in tower.parameters()),
            "mm_projector": sum(p.numel() for p in projector.parameters())}


class Projector(nn.Module):
    """Merged patches [n, M, Dv] -> [n, D]. V2 (``patchmergerv2``): proj.0 (no bias) -> GELU -> proj.2 (no bias) ->
    post_norm (RMSNorm). K2.5 (``patchmerger``): pre_norm (LayerNorm per patch) -> proj.0 -> GELU -> proj.2."""

    def __init__(self, cfg: VisionConfig, text_hidden: int):
        super().__init__()
        width = cfg.merge * cfg.vt_hidden_size
        self.v2 = cfg.mm_projector_type == "patchmergerv2"
        if not self.v2:
            self.pre_norm = nn.LayerNorm(cfg.vt_hidden_size, eps=cfg.projector_ln_eps)
        self.proj = nn.Sequential(nn.Linear(width, width, bias=not self.v2), nn.GELU(),
                                  nn.Linear(width, text_hidden, bias=not self.v2))
        if self.v2:
            self.post_norm = nn.RMSNorm(text_hidden, eps=cfg.projector_ln_eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.v2:
            x = self.pre_norm(x)
        x = self.proj(x.flatten(1))
        return self.post_norm(x) if self.v2 else x


@torch.no_grad()
def _init_vision(module: nn.Module, num_layers: int, std: float = 0.02) -> None:
    """N(0, std) for matrices and the position grid, output projections (wo, fc1, proj.2) scaled by 1/sqrt(2L),
    zero biases, norms at 1."""
    out_std = std / (2 * num_layers) ** 0.5
    for name, m in module.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if isinstance(m, (nn.Linear, nn.Conv2d)):
            nn.init.normal_(m.weight, std=out_std if leaf in ("wo", "fc1", "2") else std)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, (nn.LayerNorm, nn.RMSNorm)):
            nn.init.ones_(m.weight)
            if getattr(m, "bias", None) is not None:
                nn.init.zeros_(m.bias)
        elif hasattr(m, "weight") and leaf == "pos_emb":
            nn.init.normal_(m.weight, std=std)


class K3ForConditionalGeneration(nn.Module):
    """``config``: the text model's K3Config; its ``top_level`` (the multimodal wrapper of config.json) holds
    ``vision_config`` and ``media_placeholder_token_id``. ``vision`` / ``media_placeholder_token_id`` set them
    (and are written into ``config.top_level``, so that ``k3.pretrained.save_pretrained`` writes the release's wrapper).
    ``language_model``: a text model to give the new tower and projector to (its weights kept; ``k3 sft --vision``)
    instead of a freshly initialised one."""

    def __init__(self, config: K3Config, vision: VisionConfig | None = None,
                 media_placeholder_token_id: int | None = None, language_model: K3ForCausalLM | None = None):
        super().__init__()
        vision = vision or vision_of(config.top_level)
        if vision is None:
            raise ValueError("K3ForConditionalGeneration needs a vision config: pass vision=VisionConfig.preset(...) "
                             "or a config whose top_level (the config.json wrapper) has vision_config")
        if vision.text_hidden_size not in (None, config.hidden_size):
            raise ValueError(f"vision_config.text_hidden_size = {vision.text_hidden_size} but the language model's "
                             f"hidden_size is {config.hidden_size}: the projector must write the LM's width")
        top = dict(config.top_level or {})
        top["vision_config"] = vision.to_hf()
        if media_placeholder_token_id is not None:
            top["media_placeholder_token_id"] = media_placeholder_token_id
        top["media_placeholder_token_id"] = placeholder_of(top)
        self.media_placeholder_token_id = int(top["media_placeholder_token_id"])
        if not 0 <= self.media_placeholder_token_id < config.vocab_size:
            raise ValueError(f"media_placeholder_token_id {self.media_placeholder_token_id} is outside the vocabulary "
                             f"[0, {config.vocab_size}); give the id of the tokenizer's image placeholder token")
        self.config = config.replace(top_level=top)
        self.vision_config = vision
        if language_model is None:
            language_model = K3ForCausalLM(self.config)
        elif language_model.config.replace(top_level=None) != self.config.replace(top_level=None):
            raise ValueError("language_model was built for another config than the one given: pass its own config")
        language_model.config = self.config
        self.language_model = language_model
        self.vision_tower = MoonViT(vision)
        self.mm_projector = Projector(vision, config.hidden_size)
        _init_vision(self.vision_tower, vision.vt_num_hidden_layers)
        _init_vision(self.mm_projector, vision.vt_num_hidden_layers)

    # ---- images -----------------------------------------------------------------------------------------------
    def encode_images(self, pixels: torch.Tensor, grids: Sequence[tuple[int, int]]) -> torch.Tensor:
        """Packed images (pixels [patches,3,p,p], ``grids`` [(h, w)]) -> their tokens' embeddings [n, D], image after
        image, each image's tokens row-major over its merged grid."""
        return self.mm_projector(self.vision_tower(pixels, grids))

    def encode_image_pieces(self, pixels: torch.Tensor, grid: tuple[int, int], piece_flops: float):
        """``encode_images`` of one image in pieces of about ``piece_flops`` each (``k3.vision.stepwise``): a
        generator yielding each piece's FLOPs and returning the embeddings [n, D]. The engine runs a few per step."""
        return encode_in_pieces(self.vision_tower, self.mm_projector, pixels, grid, piece_flops)

    def embed(self, input_ids: torch.Tensor, pixels: torch.Tensor | None = None,
              grids: Sequence[tuple[int, int]] = (), image_tokens: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids [B,T] -> [B,T,D]: token embeddings with the images' embeddings at the placeholder positions
        (in reading order, row by row of the batch). ``image_tokens`` [n]: which rows of ``encode_images`` the
        placeholders take, in their order (a packed row holding part of an image); None: all of them."""
        x = self.language_model.model.embed_tokens(input_ids)
        mask = input_ids == self.media_placeholder_token_id
        n_slots = int(mask.sum())
        n_image = sum(tokens_per_image(g, self.vision_config) for g in grids)
        n_taken = n_image if image_tokens is None else len(image_tokens)
        if n_slots != n_taken:
            raise ValueError(f"the input has {n_slots} image placeholder tokens (id {self.media_placeholder_token_id}) "
                             f"but the images {list(grids)} give {n_taken} tokens"
                             + ("" if image_tokens is None else " (image_tokens)") + ": each image needs h*w/"
                             f"{self.vision_config.merge} placeholders (k3.vision.encode_chat builds such prompts)")
        if not n_image:
            return x
        features = self.encode_images(pixels, grids).to(x.dtype)  # [n_image, D]
        if image_tokens is not None:
            features = features[image_tokens]
        return x.masked_scatter(mask[..., None], features)

    # ---- the model --------------------------------------------------------------------------------------------
    def forward(self, input_ids: torch.Tensor, pixels: torch.Tensor | None = None,
                grids: Sequence[tuple[int, int]] = (), labels: torch.Tensor | None = None,
                image_tokens: torch.Tensor | None = None, **kwargs) -> CausalLMOutput:
        """As ``K3ForCausalLM.forward`` (``cu_seqlens``, ``mtp_weight``, ``return_logits``, ...), with the images of
        the input: ``pixels`` [patches,3,p,p] and ``grids`` [(h, w)] in placeholder order (``image_tokens``: as
        ``embed``). Labels at placeholder positions are ignored."""
        if labels is not None:
            labels = labels.masked_fill(input_ids == self.media_placeholder_token_id, -100)
        return self.language_model(input_ids, labels=labels,
                                   inputs_embeds=self.embed(input_ids, pixels, grids, image_tokens), **kwargs)

    def fuse_projections(self) -> "K3ForConditionalGeneration":
        """For inference: the language model's fused projections (``K3ForCausalLM.fuse_projections``)."""
        self.language_model.fuse_projections()
        return self

    def set_kda_backend(self, backend: str) -> None:
        self.language_model.set_kda_backend(backend)
