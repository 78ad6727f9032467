"""K3Config: the whole text-model configuration (SPEC §1), its presets, and the HF ``config.json`` layout.

Field names follow the published ``text_config`` so that a reader can hold the two side by side. The
HF layout nests the KDA settings under ``linear_attn_config`` and lists layers 1-based; ``from_hf`` /
``to_hf`` translate (k3/config_hf.py: the Kimi Linear and K3 release layouts), and a round trip is lossless
(housekeeping keys are carried verbatim in ``extra``).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

__all__ = ["K3Config", "PRESETS", "hybrid_layers"]

def hybrid_layers(num_layers: int, every: int = 4) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """K3's pattern, 1-based: MLA at every ``every``-th layer and the last; KDA elsewhere -> (mla, kda)."""
    mla = tuple(i for i in range(1, num_layers + 1) if i % every == 0 or i == num_layers)
    return mla, tuple(i for i in range(1, num_layers + 1) if i not in mla)


@dataclass(frozen=True)
class K3Config:
    # trunk
    vocab_size: int = 163840
    hidden_size: int = 7168
    num_hidden_layers: int = 93
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    # sequence axis: which layers are MLA (full attention) / KDA, 1-based as in the HF config
    full_attn_layers: tuple[int, ...] = hybrid_layers(93)[0]
    kda_layers: tuple[int, ...] = hybrid_layers(93)[1]
    # KDA (linear_attn_config)
    kda_num_heads: int = 96
    kda_head_dim: int = 128
    short_conv_kernel_size: int = 4
    gate: str = "lower_bound"  # "lower_bound" (K3) or "softplus" (Kimi Linear)
    gate_lower_bound: float = -5.0
    use_full_rank_gate: bool = True
    # Gated MLA
    num_attention_heads: int = 96
    q_lora_rank: int | None = 1536
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    mla_use_nope: bool = True
    mla_use_output_gate: bool = True
    rope_theta: float = 50000.0  # only read when mla_use_nope is False (Kimi K2)
    # YaRN context extension of that RoPE, as DeepSeek-V3 / Kimi K2 configs write it: {"type": "yarn", "factor",
    # "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale", "mscale_all_dim"}; None = plain RoPE
    rope_scaling: dict | None = None
    # width axis
    intermediate_size: int = 33792  # the dense first layer(s)
    first_k_dense_replace: int = 1
    num_experts: int = 896
    num_experts_per_token: int = 16
    num_shared_experts: int = 2
    moe_intermediate_size: int = 3072
    routed_expert_hidden_size: int | None = 3584  # latent width; None = plain (non-latent) MoE
    latent_moe_use_norm: bool = True
    moe_router_activation_func: str = "sigmoid"
    moe_renormalize: bool = True
    routed_scaling_factor: float = 1.0
    num_expert_group: int = 1
    topk_group: int = 1
    hidden_act: str = "situ"  # "situ" or "silu" (SwiGLU)
    activation_situ_beta: float = 4.0
    activation_situ_linear_beta: float = 25.0
    # depth axis: "block" (K3), "full" (every sub-layer is a source), "none" (plain residual)
    attn_res: str = "block"
    attn_res_block_size: int = 12
    # multi-token prediction
    num_nextn_predict_layers: int = 0
    # context and special tokens (None: not known; a checkpoint with a tokenizer sets them)
    max_position_embeddings: int = 1 << 20
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None
    # quantisation-aware training (SPEC §6): "mxfp4" = routed experts run MXFP4 weights and MXFP8 inputs (fake-quant,
    # straight-through gradients); written as "k3_qat" in config.json
    qat: str | None = None
    # HF keys carried verbatim for a lossless round trip; top_level holds the multimodal wrapper (None = bare)
    extra: dict = field(default_factory=dict, compare=True, repr=False)
    top_level: dict | None = field(default=None, compare=True, repr=False)

    def __post_init__(self):
        _validate(self)

    # ---- derived -------------------------------------------------------------------------------------
    def layer_kind(self, i: int) -> str:
        """'kda' or 'mla' for 0-based decoder layer i."""
        return "mla" if (i + 1) in self.full_attn_layers else "kda"

    def is_moe_layer(self, i: int) -> bool:
        return i >= self.first_k_dense_replace and self.num_experts > 0

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_moe(self) -> bool:
        return self.routed_expert_hidden_size is not None

    @property
    def expert_dim(self) -> int:
        """Width the routed experts read and write: the latent width, or hidden for a plain MoE."""
        return self.routed_expert_hidden_size or self.hidden_size

    def replace(self, **changes) -> "K3Config":
        return dataclasses.replace(self, **changes)

    def variant(self, *, attn_res: str | None = None, gate: str | None = None, activation: str | None = None,
                latent_moe: bool | None = None, latent_moe_norm: bool | None = None,
                layers: str | None = None) -> "K3Config":
        """Switch K3 mechanisms off (or on) for comparisons.

        attn_res: block | full | none; gate: lower_bound | softplus; activation: situ | swiglu;
        latent_moe / latent_moe_norm: bool; layers: hybrid | all-mla | all-kda.
        """
        ch: dict[str, Any] = {}
        if attn_res is not None:
            ch["attn_res"] = attn_res
            if attn_res == "none":  # the block size means nothing then; keep the canonical default
                ch["attn_res_block_size"] = K3Config.attn_res_block_size
        if gate is not None:
            ch["gate"] = gate
        if activation is not None:
            ch["hidden_act"] = {"swiglu": "silu"}.get(activation, activation)
        if latent_moe is not None:
            ch["routed_expert_hidden_size"] = (self.routed_expert_hidden_size or self.hidden_size // 2) if latent_moe else None
        if latent_moe_norm is not None:
            ch["latent_moe_use_norm"] = latent_moe_norm
        if layers is not None:
            n = self.num_hidden_layers
            pats = {"hybrid": hybrid_layers(n), "all-mla": (tuple(range(1, n + 1)), ()),
                    "all-kda": ((), tuple(range(1, n + 1)))}
            if layers not in pats:
                raise ValueError(f"layers must be one of {sorted(pats)}; got {layers!r}")
            ch["full_attn_layers"], ch["kda_layers"] = pats[layers]
        return self.replace(**ch)

    # ---- presets -------------------------------------------------------------------------------------
    @staticmethod
    def preset(name: str) -> "K3Config":
        if name not in PRESETS:
            raise ValueError(f"unknown preset {name!r}; available: {', '.join(PRESETS)}")
        return PRESETS[name]()

    # ---- HF config.json ------------------------------------------------------------------------------
    @classmethod
    def from_hf(cls, src: str | Path | dict, strict: bool = True) -> "K3Config":
        """Read a config.json: the K3 release (``text_config`` inside a ``kimi_k3`` wrapper), a Kimi Linear
        config (as transformers writes it), or a bare text config. ``src`` is a dict, a config.json path, or a
        directory holding config.json. A key the file lacks means what the file's ``model_type`` means by it
        (see k3/config_hf.py). Unknown keys raise, naming the file and the key (``strict=False``, or
        ``K3_CONFIG_UNKNOWN=keep`` in the environment for every k3 command, carries them through unread)."""
        from .config_hf import drop_generated, read_hf
        from .config_strict import UnknownConfigField, strict_reading

        try:
            kw = read_hf(_load_json(src), cls, strict_reading(strict))
        except UnknownConfigField as e:
            raise e.at(src) from None
        return drop_generated(cls(**kw))

    def to_hf(self) -> dict:
        """The config.json: Kimi Linear's layout when the model uses no K3-only mechanism, else the K3 release
        layout (``kimi_k3`` wrapper with ``text_config``); ``hf_layout`` says which."""
        from .config_hf import write_hf

        return write_hf(self)

    @property
    def hf_layout(self) -> str:
        """"kimi_linear" or "kimi_k3": which config.json layout (and weight layout) ``to_hf`` writes."""
        from .config_hf import hf_layout

        return hf_layout(self)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_hf(), indent=2) + "\n")


def _load_json(src) -> dict:
    if isinstance(src, dict):
        return src
    p = Path(src)
    if p.is_dir():
        p = p / "config.json"
    if not p.exists():
        raise FileNotFoundError(f"no config.json at {p}")
    try:
        return json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{p} is not valid JSON: {e}") from None


_YARN_KEYS = {"type", "rope_type", "factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale",
              "mscale_all_dim", "attention_factor", "truncate"}


def check_rope_scaling(scaling: dict) -> None:
    """Raise ValueError saying what is wrong with a ``rope_scaling`` dict k3 cannot compute exactly."""
    if not isinstance(scaling, dict):
        raise ValueError(f"must be a dict (or None), got {type(scaling).__name__}")
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind != "yarn":
        raise ValueError(f"rope type {kind!r} is not implemented: k3's MLA rotates plainly or with YaRN "
                         "({'type': 'yarn', ...}, as Kimi K2's config)")
    unknown = sorted(set(scaling) - _YARN_KEYS)
    if unknown:
        raise ValueError(f"unknown YaRN key(s) {unknown}; k3 reads {sorted(_YARN_KEYS)}")
    for key in ("factor", "original_max_position_embeddings"):
        v = scaling.get(key)
        if not isinstance(v, (int, float)) or isinstance(v, bool) or v <= 0:
            raise ValueError(f"YaRN needs a positive {key!r}, got {v!r}")


def _validate(c: K3Config) -> None:
    def need(ok: bool, field_name: str, msg: str):
        if not ok:
            raise ValueError(f"K3Config.{field_name}: {msg}")

    for name in ("vocab_size", "hidden_size", "num_hidden_layers", "kda_num_heads", "kda_head_dim",
                 "num_attention_heads", "kv_lora_rank", "v_head_dim", "intermediate_size"):
        need(isinstance(getattr(c, name), int) and getattr(c, name) > 0, name, f"must be a positive int, got {getattr(c, name)!r}")
    if c.rope_scaling is not None:
        need(not c.mla_use_nope, "rope_scaling", "applies to MLA with RoPE (mla_use_nope = False, Kimi K2); this "
                                                 "model's MLA uses no position encoding")
        try:
            check_rope_scaling(c.rope_scaling)
        except ValueError as e:
            need(False, "rope_scaling", str(e))
    n = c.num_hidden_layers
    both = set(c.full_attn_layers) & set(c.kda_layers)
    need(not both, "full_attn_layers", f"layer(s) {sorted(both)} are listed as both MLA and KDA")
    for name in ("full_attn_layers", "kda_layers"):
        bad = [i for i in getattr(c, name) if not 1 <= i <= n]
        need(not bad, name, f"layer indices are 1-based in [1, {n}]; got {bad}")
        need(len(set(getattr(c, name))) == len(getattr(c, name)), name, "has duplicate layers")
    missing = set(range(1, n + 1)) - set(c.full_attn_layers) - set(c.kda_layers)
    need(not missing, "kda_layers", f"layer(s) {sorted(missing)} are neither KDA nor MLA")
    need(c.gate in ("lower_bound", "softplus"), "gate", f"must be 'lower_bound' or 'softplus', got {c.gate!r}")
    need(c.gate_lower_bound < 0, "gate_lower_bound", f"must be negative, got {c.gate_lower_bound}")
    need(c.short_conv_kernel_size >= 1, "short_conv_kernel_size", "must be >= 1")
    need(c.hidden_act in ("situ", "silu"), "hidden_act", f"must be 'situ' or 'silu', got {c.hidden_act!r}")
    need(c.attn_res in ("block", "full", "none"), "attn_res", f"must be block, full or none, got {c.attn_res!r}")
    need(c.attn_res_block_size >= 1, "attn_res_block_size", "must be >= 1")
    need(0 <= c.first_k_dense_replace <= n, "first_k_dense_replace", f"must be in [0, {n}]")
    need(c.q_lora_rank is None or c.q_lora_rank > 0, "q_lora_rank", "must be positive or None")
    need(c.qk_nope_head_dim >= 0 and c.qk_rope_head_dim >= 0 and c.qk_head_dim > 0, "qk_nope_head_dim",
         "head dims must be non-negative with a positive sum")
    if c.first_k_dense_replace < n:
        need(c.num_experts >= 1, "num_experts", "must be >= 1 when any layer is MoE")
        need(1 <= c.num_experts_per_token <= c.num_experts, "num_experts_per_token",
             f"must be in [1, num_experts={c.num_experts}], got {c.num_experts_per_token}")
        need(c.moe_intermediate_size > 0, "moe_intermediate_size", "must be positive")
        need(c.num_shared_experts >= 0, "num_shared_experts", "must be >= 0")
        need(c.routed_expert_hidden_size is None or c.routed_expert_hidden_size > 0, "routed_expert_hidden_size",
             "must be positive or None")
        need(c.moe_router_activation_func in ("sigmoid", "softmax"), "moe_router_activation_func",
             f"must be 'sigmoid' or 'softmax', got {c.moe_router_activation_func!r}")
        need(c.num_expert_group == 1 and c.topk_group == 1, "num_expert_group",
             "grouped top-k (num_expert_group > 1) is not implemented; K3, K2 and Kimi Linear all use 1")
    need(c.num_nextn_predict_layers >= 0, "num_nextn_predict_layers", "must be >= 0")
    need(c.qat in (None, "mxfp4"), "qat", f"must be None or 'mxfp4' (MXFP4 experts, MXFP8 inputs); got {c.qat!r}")
    if c.qat is not None:
        width = "routed_expert_hidden_size" if c.latent_moe else "hidden_size"
        bad = {k: v for k, v in ((width, c.expert_dim),
                                 ("moe_intermediate_size", c.moe_intermediate_size)) if v % 32}
        need(not bad, "qat", f"MXFP4/MXFP8 blocks are 32 values along each expert matmul's input: {bad} must be "
             "multiples of 32")


# ---- presets ----------------------------------------------------------------------------------------

def kimi_k3() -> K3Config:
    """The official Kimi K3 text model (SPEC §1): 2.78T total, 104B active."""
    return K3Config()


def kimi_k2() -> K3Config:
    """Kimi K2 (DeepSeek-V3 architecture): 61 MLA layers with RoPE, 384 experts top-8, SwiGLU, no AttnRes."""
    mla, kda = tuple(range(1, 62)), ()
    return K3Config(num_hidden_layers=61, full_attn_layers=mla, kda_layers=kda, num_attention_heads=64,
                    mla_use_nope=False, mla_use_output_gate=False, intermediate_size=18432, num_experts=384,
                    num_experts_per_token=8, num_shared_experts=1, moe_intermediate_size=2048,
                    routed_expert_hidden_size=None, routed_scaling_factor=2.827, hidden_act="silu", attn_res="none")


def kimi_linear_48b() -> K3Config:
    """Kimi Linear 48B-A3B: 3 KDA : 1 MLA with the softplus gate, low-rank output gate, plain MoE."""
    mla = (4, 8, 12, 16, 20, 24, 27)
    return K3Config(hidden_size=2304, num_hidden_layers=27, full_attn_layers=mla,
                    kda_layers=tuple(i for i in range(1, 28) if i not in mla), kda_num_heads=32, kda_head_dim=128,
                    gate="softplus", use_full_rank_gate=False, num_attention_heads=32, q_lora_rank=None,
                    mla_use_output_gate=False, intermediate_size=9216, num_experts=256, num_experts_per_token=8,
                    num_shared_experts=1, moe_intermediate_size=1024, routed_expert_hidden_size=None,
                    routed_scaling_factor=2.446, hidden_act="silu", attn_res="none")


def tiny() -> K3Config:
    """Every K3 mechanism at CPU-test size (< 2M params): KDA + MLA, dense + latent MoE, 3 AttnRes blocks, MTP."""
    mla, kda = hybrid_layers(6)
    return K3Config(vocab_size=1024, hidden_size=64, num_hidden_layers=6, full_attn_layers=mla, kda_layers=kda,
                    kda_num_heads=4, kda_head_dim=16, num_attention_heads=4, q_lora_rank=32, kv_lora_rank=32,
                    qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, intermediate_size=128, num_experts=8,
                    num_experts_per_token=2, num_shared_experts=1, moe_intermediate_size=32,
                    routed_expert_hidden_size=32, attn_res_block_size=2, num_nextn_predict_layers=1)


def small() -> K3Config:
    """A one-GPU K3 (~290M total, ~100M active): head dim 128 so that fla's kernels apply."""
    mla, kda = hybrid_layers(12)
    return K3Config(vocab_size=32768, hidden_size=768, num_hidden_layers=12, full_attn_layers=mla, kda_layers=kda,
                    kda_num_heads=6, kda_head_dim=128, num_attention_heads=6, q_lora_rank=384, kv_lora_rank=256,
                    qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64, intermediate_size=2048, num_experts=32,
                    num_experts_per_token=4, num_shared_experts=1, moe_intermediate_size=384,
                    routed_expert_hidden_size=384, attn_res_block_size=4, num_nextn_predict_layers=1)


def medium() -> K3Config:
    """A one-GPU K3 at ~1B active (3.29B total, 1.06B active): hidden 2048, 24 layers in K3's 3:1 pattern (MLA at
    4, 8, ..., 24), K3's head dims (KDA 128, MLA 128 + 64 / 128), 64 experts top-8 in a latent half the width,
    AttnRes blocks of 6 decoder layers (4 blocks), one MTP layer."""
    mla, kda = hybrid_layers(24)
    return K3Config(vocab_size=32768, hidden_size=2048, num_hidden_layers=24, full_attn_layers=mla, kda_layers=kda,
                    kda_num_heads=16, kda_head_dim=128, num_attention_heads=16, q_lora_rank=768, kv_lora_rank=512,
                    qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, intermediate_size=8192,
                    num_experts=64, num_experts_per_token=8, num_shared_experts=1, moe_intermediate_size=512,
                    routed_expert_hidden_size=1024, attn_res_block_size=6, num_nextn_predict_layers=1)


PRESETS: dict[str, Callable[[], K3Config]] = {
    "kimi-k3": kimi_k3,
    "kimi-k2": kimi_k2,
    "kimi-linear-48b": kimi_linear_48b,
    "tiny": tiny,
    "small": small,
    "medium": medium,
}
