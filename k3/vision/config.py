"""VisionConfig: the vision tower and projector of a K3 (MoonViT-V2) or Kimi K2.5 (MoonViT) checkpoint, SPEC §10.

Field names are the K3 release's ``vision_config`` keys (``vt_hidden_size``, ``qkv_hidden_size``, ``norm_type``,
...), so the two read side by side. ``from_hf`` also reads Kimi K2.5's layout: the release's (``hidden_size``,
``num_attention_heads``, ... in ``vision_config``, the projector's keys in the wrapper) and the one transformers'
``Kimi_K25Config`` writes (``pos_emb_height``, ``hidden_act``, ``projection_layer_norm_eps``). ``to_hf`` writes
the K3 release's keys; a round trip is lossless (unknown keys are carried verbatim in ``extra``).

Where V2 differs from K2.5's MoonViT (both are implemented; the field says which):

| field | K2.5 MoonViT | K3 MoonViT-V2 |
|---|---|---|
| width / heads / MLP / layers | 1152 / 16 / 4304 / 27 | 1024 / 12 / 4096 / 27 |
| ``qkv_hidden_size`` (attention width) | = width (head dim 72) | 1536 (12 heads x 128) |
| ``norm_type`` (encoder and final norm) | LayerNorm | RMSNorm |
| biases (``attn_bias``, ``linear_bias``, ``patch_embed_proj_bias``) | yes | none |
| ``pos_emb_interpolation_mode`` (position grid resampling) | bicubic | bilinear |
| ``mm_projector_type`` | ``patchmerger``: LayerNorm -> Linear -> GELU -> Linear | ``patchmergerv2``: Linear -> GELU -> Linear -> RMSNorm, no biases |
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable

__all__ = ["VisionConfig", "VISION_PRESETS", "DEFAULT_MEDIA_PLACEHOLDER_ID", "vision_of", "placeholder_of"]

DEFAULT_MEDIA_PLACEHOLDER_ID = 163605  # ``<|media_pad|>`` in the Kimi tokenizers (K2.5 and K3 configs)
_ACTS = ("gelu_pytorch_tanh", "gelu")
_PROJECTORS = ("patchmergerv2", "patchmerger")


@dataclass(frozen=True)
class VisionConfig:
    patch_size: int = 14
    init_pos_emb_height: int = 64  # the learned position grid, resampled to each image's grid
    init_pos_emb_width: int = 64
    init_pos_emb_time: int = 4  # frames of the video position table (kept for the round trip; k3 reads images)
    pos_emb_interpolation_mode: str = "bilinear"
    vt_hidden_size: int = 1024
    vt_num_attention_heads: int = 12
    vt_num_hidden_layers: int = 27
    vt_intermediate_size: int = 4096
    qkv_hidden_size: int | None = 1536  # None: the width
    norm_type: str = "rmsnorm"
    attn_bias: bool = False
    linear_bias: bool = False
    patch_embed_proj_bias: bool = False
    activation_func: str = "gelu_pytorch_tanh"
    rope_theta: float = 10000.0
    merge_kernel_size: tuple[int, int] = (2, 2)
    mm_projector_type: str = "patchmergerv2"
    projector_hidden_act: str = "gelu"
    projector_ln_eps: float = 1e-5
    text_hidden_size: int | None = None  # the LM's width the projector writes (None: the language model's)
    extra: dict = field(default_factory=dict, compare=True, repr=False)

    def __post_init__(self):
        _validate(self)

    @property
    def attention_width(self) -> int:
        return self.qkv_hidden_size or self.vt_hidden_size

    @property
    def head_dim(self) -> int:
        return self.attention_width // self.vt_num_attention_heads

    @property
    def merge(self) -> int:
        """Patches per image token (2 x 2 = 4)."""
        return self.merge_kernel_size[0] * self.merge_kernel_size[1]

    @property
    def unit(self) -> int:
        """Image sides are padded to multiples of this many pixels (patch x merge kernel: 28)."""
        return self.patch_size * max(self.merge_kernel_size)

    def replace(self, **changes) -> "VisionConfig":
        return dataclasses.replace(self, **changes)

    @staticmethod
    def preset(name: str) -> "VisionConfig":
        if name not in VISION_PRESETS:
            raise ValueError(f"unknown vision preset {name!r}; available: {', '.join(VISION_PRESETS)}")
        return VISION_PRESETS[name]()

    # ---- config.json ----------------------------------------------------------------------------------------
    @classmethod
    def from_hf(cls, vision: dict, wrapper: dict | None = None) -> "VisionConfig":
        """Read a ``vision_config`` dict (and the projector keys of its multimodal wrapper, K2.5's place for them):
        the K3 release's keys, K2.5's, or those transformers' ``Kimi_K25Config`` writes. A key the file lacks takes
        the value of the tower its ``model_type`` names (K2.5 for ``kimi_k25*`` and configs without the V2-only keys,
        else V2)."""
        d = dict(vision)
        w = dict(wrapper or {})
        k25 = (w.get("model_type") == "kimi_k25" or str(d.get("model_type", "")).startswith("kimi_k25")
               or ("vt_hidden_size" not in d and "hidden_size" in d))
        kw = {f.name: getattr(k25_moonvit() if k25 else moonvit_v2(), f.name)
              for f in dataclasses.fields(cls) if f.name != "extra"}
        for ours, names in _ALIASES.items():
            for name in names:
                if name in d:
                    kw[ours] = d.pop(name)
        rope = d.pop("rope_parameters", None) or {}
        if rope:
            if rope.get("rope_type", "axial") != "axial":
                raise ValueError(f"vision_config.rope_parameters.rope_type {rope.get('rope_type')!r}: MoonViT rotates "
                                 "with 2-D axial RoPE only")
            kw["rope_theta"] = float(rope.get("rope_theta", kw["rope_theta"]))
        for name in _PROJECTOR_KEYS:  # K2.5 keeps the projector's settings beside vision_config
            for src in (d, w):
                if name in src:
                    kw[_PROJECTOR_KEYS[name]] = src.pop(name) if src is d else src[name]
        for key, value in _FIXED.items():  # written back by to_hf
            got = d.pop(key, value)
            if got != value:
                raise ValueError(f"vision_config.{key}: k3 builds {value!r} only; got {got!r}")
        names = {f.name for f in dataclasses.fields(cls)} - {"extra"}
        for k in list(d):
            if k in names:
                kw[k] = d.pop(k)
        kw["merge_kernel_size"] = tuple(kw["merge_kernel_size"])
        if kw["pos_emb_interpolation_mode"] is None:
            kw["pos_emb_interpolation_mode"] = "bicubic"
        return cls(**kw, extra=d)

    def to_hf(self) -> dict:
        """The ``vision_config`` dict in the K3 release's keys (plus carried keys)."""
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in ("extra", "rope_theta")}
        d["merge_kernel_size"] = list(self.merge_kernel_size)
        d["merge_type"], d["pos_emb_type"], d["mlp_type"] = "sd2_tpool", "divided_fixed", "mlp2"
        if self.rope_theta != 10000.0:
            d["rope_theta"] = self.rope_theta
        if d["text_hidden_size"] is None:
            del d["text_hidden_size"]
        return {**d, **self.extra}


# our field -> the names other layouts use for it (K2.5's release, transformers' Kimi_K25VisionConfig)
_ALIASES = {"vt_hidden_size": ("hidden_size",), "vt_num_attention_heads": ("num_attention_heads",),
            "vt_num_hidden_layers": ("num_hidden_layers",), "vt_intermediate_size": ("intermediate_size",),
            "init_pos_emb_height": ("pos_emb_height",), "init_pos_emb_width": ("pos_emb_width",),
            "init_pos_emb_time": ("pos_emb_time",), "activation_func": ("hidden_act",)}
# projector keys: K2.5's wrapper (and transformers' names for them) -> our field
_PROJECTOR_KEYS = {"mm_projector_type": "mm_projector_type", "projector_hidden_act": "projector_hidden_act",
                   "projector_ln_eps": "projector_ln_eps", "projection_layer_norm_eps": "projector_ln_eps"}
# keys that say how the release's own code is organised, not what it computes: accepted at the one value k3 builds
_FIXED = {"merge_type": "sd2_tpool", "pos_emb_type": "divided_fixed", "mlp_type": "mlp2"}


def _validate(c: VisionConfig) -> None:
    def need(ok: bool, name: str, msg: str):
        if not ok:
            raise ValueError(f"vision_config.{name}: {msg}")

    for name in ("patch_size", "init_pos_emb_height", "init_pos_emb_width", "vt_hidden_size", "vt_num_attention_heads",
                 "vt_num_hidden_layers", "vt_intermediate_size"):
        v = getattr(c, name)
        need(isinstance(v, int) and v > 0, name, f"must be a positive int, got {v!r}")
    need(c.attention_width % c.vt_num_attention_heads == 0, "qkv_hidden_size",
         f"the attention width {c.attention_width} must split into vt_num_attention_heads = "
         f"{c.vt_num_attention_heads} heads")
    need(c.head_dim % 4 == 0, "qkv_hidden_size", f"2-D RoPE rotates pairs per axis: the head dim {c.head_dim} must "
         "be a multiple of 4")
    need(c.norm_type in ("rmsnorm", "layernorm"), "norm_type", f"must be 'rmsnorm' or 'layernorm', got {c.norm_type!r}")
    need(c.activation_func in _ACTS, "activation_func", f"must be one of {_ACTS}, got {c.activation_func!r}")
    need(c.mm_projector_type in _PROJECTORS, "mm_projector_type",
         f"must be one of {_PROJECTORS}, got {c.mm_projector_type!r}")
    need(c.projector_hidden_act == "gelu", "projector_hidden_act", f"must be 'gelu', got {c.projector_hidden_act!r}")
    need(c.pos_emb_interpolation_mode in ("bilinear", "bicubic"), "pos_emb_interpolation_mode",
         f"must be 'bilinear' or 'bicubic', got {c.pos_emb_interpolation_mode!r}")
    need(len(c.merge_kernel_size) == 2 and all(isinstance(k, int) and k > 0 for k in c.merge_kernel_size),
         "merge_kernel_size", f"must be two positive ints, got {c.merge_kernel_size!r}")
    need(c.text_hidden_size is None or c.text_hidden_size > 0, "text_hidden_size", "must be positive or absent")


# ---- presets --------------------------------------------------------------------------------------------------

def moonvit_v2() -> VisionConfig:
    """K3's MoonViT-V2 (the release's vision_config): 401.2M parameters, plus a 46.1M projector into hidden 7168."""
    return VisionConfig()


def k25_moonvit() -> VisionConfig:
    """Kimi K2.5's MoonViT, as transformers' ``Kimi_K25VisionConfig`` and the K2.5 release describe it."""
    return VisionConfig(pos_emb_interpolation_mode="bicubic", vt_hidden_size=1152, vt_num_attention_heads=16,
                        vt_intermediate_size=4304, qkv_hidden_size=None, norm_type="layernorm", attn_bias=True,
                        linear_bias=True, patch_embed_proj_bias=True, mm_projector_type="patchmerger")


def tiny() -> VisionConfig:
    """V2's design at CPU-test size: 2 layers, width 64, 4 heads of 16, an 8 x 8 position grid."""
    return VisionConfig(init_pos_emb_height=8, init_pos_emb_width=8, vt_hidden_size=64, vt_num_attention_heads=4,
                        vt_num_hidden_layers=2, vt_intermediate_size=128, qkv_hidden_size=64)


VISION_PRESETS: dict[str, Callable[[], VisionConfig]] = {"moonvit-v2": moonvit_v2, "k25-moonvit": k25_moonvit,
                                                        "tiny": tiny}


def vision_of(top_level: dict[str, Any] | None) -> VisionConfig | None:
    """The VisionConfig of a multimodal wrapper (``K3Config.top_level``), or None when it has no ``vision_config``."""
    if not top_level or "vision_config" not in top_level:
        return None
    return VisionConfig.from_hf(top_level["vision_config"], top_level)


def placeholder_of(top_level: dict[str, Any]) -> int:
    """The image placeholder token id of a multimodal wrapper: ``media_placeholder_token_id`` (transformers'
    Kimi_K25Config names it ``image_token_id``), else the Kimi tokenizers' ``<|media_pad|>``."""
    default = top_level.get("image_token_id", DEFAULT_MEDIA_PLACEHOLDER_ID)
    return int(top_level.get("media_placeholder_token_id", default))
