"""The ``config.json`` layouts of the Kimi releases, read into and written from ``K3Config`` (SPEC §1).

Two layouts, chosen by what the model is (``hf_layout``):
- ``kimi_linear``: a bare text config, ``model_type: "kimi_linear"``, as transformers' ``KimiLinearConfig`` and
  mlx-lm's ``kimi_linear`` reader expect (no K3 mechanism: no AttnRes, no latent MoE, no MLA output gate, the
  softplus gate, SwiGLU). Written with the keys those readers need (``model_max_length``, ``head_dim``,
  ``rope_theta``, ``num_key_value_heads``, ``layer_types`` / ``mlp_layer_types``, token ids).
- ``kimi_k3``: the K3 release, ``{"model_type": "kimi_k3", "architectures": [...], "text_config": {...}}``, as
  mlx-lm's ``kimi_k3`` reader expects; the text config itself says ``model_type: "kimi_linear"`` as the release's
  does.

Reading: a key the file lacks takes the value of the architecture its (outermost) ``model_type`` names:
``kimi_linear`` -> transformers' ``KimiLinearConfig`` defaults (the Kimi-Linear-48B shapes, softplus gate,
no output gate, plain MoE, first layer dense); ``kimi_k3`` or no model_type -> K3's sizes, and a K3 mechanism
whose key is absent is off (as in every published reader). transformers' aliases (``num_local_experts``,
``num_experts_per_tok``, ``n_shared_experts``, ``norm_topk_prob``, ``n_group``, ``model_max_length``) are
accepted; keys transformers derives (``layer_types``, ``mlp_layer_types``, ``qk_head_dim``, ``linear_*``,
``num_key_value_heads``) are checked against the primary ones and regenerated on write. Housekeeping keys are
carried verbatim in ``extra`` (and the multimodal wrapper's own keys in ``top_level``) for a lossless round trip.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import TYPE_CHECKING, Any

from .config_strict import UnknownConfigField

if TYPE_CHECKING:
    from .config import K3Config

__all__ = ["read_hf", "write_hf", "hf_layout", "drop_generated", "KIMI_LINEAR", "KIMI_K3", "DEEPSEEK_V3"]

KIMI_LINEAR, KIMI_K3, DEEPSEEK_V3 = "kimi_linear", "kimi_k3", "deepseek_v3"
ARCHITECTURES = {KIMI_LINEAR: ["KimiLinearForCausalLM"], KIMI_K3: ["KimiK3ForConditionalGeneration"],
                 DEEPSEEK_V3: ["DeepseekV3ForCausalLM"]}
# Kimi K2 / K2.5: the DeepSeek-V3 architecture (K2.5 wraps it with a vision tower as "kimi_k25")
_K2_FAMILY = {DEEPSEEK_V3, "kimi_k2", "kimi_k25"}
TOKEN_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")
_LINEAR_KEYS = {"num_heads", "head_dim", "short_conv_kernel_size", "gate_lower_bound", "use_full_rank_gate",
                "full_attn_layers", "kda_layers"}
# keys carried verbatim (housekeeping of transformers, the release and mlx-lm; none changes the architecture)
_PASSTHROUGH = {"auto_map", "torch_dtype", "dtype", "transformers_version", "use_cache", "quantization_config",
                "attention_dropout", "hidden_dropout", "_name_or_path", "topk_method",
                "use_grouped_topk", "head_dim", "initializer_range", "moe_layer_freq", "attention_bias", "mlp_bias",
                "output_attentions", "output_hidden_states", "output_router_logits", "pretraining_tp",
                "model_type", "architectures", "ep_size", "aux_loss_alpha", "seq_aux", "moe_router_dtype"}
# transformers' KimiLinearConfig.attribute_map: the name it accepts -> ours
# and DeepSeek-V3's names (Kimi K2, K2.5)
_ALIASES = {"num_local_experts": "num_experts", "n_routed_experts": "num_experts",
            "num_experts_per_tok": "num_experts_per_token", "n_shared_experts": "num_shared_experts",
            "norm_topk_prob": "moe_renormalize", "n_group": "num_expert_group", "scoring_func": "moe_router_activation_func",
            "model_max_length": "max_position_embeddings"}
_GENERATED = {"model_type", "architectures", "head_dim"}  # written from the fields; carried only if they differ
_K3_MECHANISMS_OFF = {"mla_use_output_gate": False, "routed_expert_hidden_size": None, "latent_moe_use_norm": False}


def hf_layout(c: "K3Config") -> str:
    """``deepseek_v3`` for Kimi K2's architecture (every layer MLA with RoPE, plain MoE: transformers'
    DeepseekV3ForCausalLM), ``kimi_linear`` when the model uses no K3-only mechanism (transformers and mlx-lm read
    it as Kimi Linear), else ``kimi_k3`` (the K3 release layout)."""
    plain = (c.attn_res == "none" and not c.latent_moe and not c.mla_use_output_gate and c.hidden_act == "silu"
             and c.moe_router_activation_func == "sigmoid")
    if plain and not c.kda_layers and not c.mla_use_nope:
        return DEEPSEEK_V3
    if plain and c.gate == "softplus" and not c.use_full_rank_gate and c.mla_use_nope:
        return KIMI_LINEAR
    return KIMI_K3


def _defaults(model_type: str | None, cls) -> dict:
    """Field values for the keys a file of this model_type does not have."""
    from .config import kimi_k2, kimi_linear_48b

    if model_type == KIMI_LINEAR:
        base = kimi_linear_48b()
    elif model_type in _K2_FAMILY:
        base = kimi_k2().replace(num_nextn_predict_layers=0)
    elif model_type in (KIMI_K3, None):
        base = cls().replace(**_K3_MECHANISMS_OFF)
    else:
        raise ValueError(f"model_type {model_type!r} is not an architecture k3 builds; k3 reads 'kimi_k3' (the K3 "
                         "release), 'kimi_linear' (Kimi Linear), 'deepseek_v3' / 'kimi_k2' / 'kimi_k25' (Kimi K2, "
                         "K2.5) and configs without model_type written by k3")
    return {f.name: getattr(base, f.name) for f in dataclasses.fields(base) if f.name not in ("extra", "top_level")}


def _transformers_layers(n: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """KimiLinearConfig's default pattern (0-based i > 0 with i % 4 == 0 is full attention), 1-based."""
    mla = tuple(i + 1 for i in range(n) if i and i % 4 == 0)
    return mla, tuple(i for i in range(1, n + 1) if i not in mla)


def _need(ok: bool, msg: str) -> None:
    if not ok:
        raise ValueError(msg)


def _resolve_aliases(d: dict) -> dict:
    d = dict(d)
    for alias, name in _ALIASES.items():
        if alias in d:
            v = d.pop(alias)
            _need(name not in d or d[name] == v,
                  f"config has both {alias!r} = {v!r} and {name!r} = {d.get(name)!r}: they name the same setting "
                  "(transformers writes the first); keep one")
            d[name] = v
    return d


def _layers_from_types(types: list, n: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    _need(len(types) == n, f"layer_types has {len(types)} entries for num_hidden_layers = {n}")
    bad = sorted({t for t in types if t not in ("full_attention", "linear_attention")})
    _need(not bad, f"layer_types may hold 'full_attention' and 'linear_attention' only; got {bad}")
    return (tuple(i + 1 for i, t in enumerate(types) if t == "full_attention"),
            tuple(i + 1 for i, t in enumerate(types) if t == "linear_attention"))


def _read_linear(d: dict, kw: dict, model_type: str | None, strict: bool) -> dict | None:
    """The KDA settings: ``linear_attn_config`` (the release), else transformers' flat keys; returns unknown
    linear_attn_config keys to carry."""
    n = kw["num_hidden_layers"]
    lin = d.pop("linear_attn_config", None)
    flat = {"num_heads": d.pop("linear_num_heads", None), "head_dim": d.pop("linear_head_dim", None),
            "short_conv_kernel_size": d.pop("linear_conv_kernel_dim", None)}
    types = d.pop("layer_types", None)
    extra_lin = None
    if lin is not None:
        unknown = set(lin) - _LINEAR_KEYS
        if unknown and strict:
            raise UnknownConfigField(f"unknown field(s) {sorted(unknown)} in linear_attn_config (known: "
                                     f"{sorted(_LINEAR_KEYS)})")
        extra_lin = {k: lin[k] for k in unknown} or None
        for key, v in flat.items():  # transformers writes both; they must agree
            _need(v is None or key not in lin or lin[key] == v,
                  f"linear_attn_config.{key} = {lin.get(key)!r} but the flat transformers key says {v!r}")
        lin = {**{k: v for k, v in flat.items() if v is not None}, **lin}
        if "full_attn_layers" in lin or "kda_layers" in lin:
            layers = tuple(lin.get("full_attn_layers", ())), tuple(lin.get("kda_layers", ()))
        elif types is not None:
            layers = _layers_from_types(types, n)
        else:
            layers = _transformers_layers(n)
        kw["use_full_rank_gate"] = lin.get("use_full_rank_gate", False)
        if lin.get("gate_lower_bound") is None:
            kw["gate"] = "softplus"
        else:
            kw["gate"], kw["gate_lower_bound"] = "lower_bound", float(lin["gate_lower_bound"])
    elif types is not None or any(v is not None for v in flat.values()):  # transformers' flat form
        lin = {k: v for k, v in flat.items() if v is not None}
        layers = _layers_from_types(types, n) if types is not None else _transformers_layers(n)
    else:  # no linear attention described: every layer is MLA (Kimi K2), or Kimi Linear's default pattern
        lin = {}
        layers = _transformers_layers(n) if model_type == KIMI_LINEAR else (tuple(range(1, n + 1)), ())
    kw["kda_num_heads"] = lin.get("num_heads", kw["kda_num_heads"])
    kw["kda_head_dim"] = lin.get("head_dim", kw["kda_head_dim"])
    kw["short_conv_kernel_size"] = lin.get("short_conv_kernel_size", kw["short_conv_kernel_size"])
    kw["full_attn_layers"], kw["kda_layers"] = (tuple(int(x) for x in layers[0]), tuple(int(x) for x in layers[1]))
    if types is not None:
        _need(_layers_from_types(types, n) == (kw["full_attn_layers"], kw["kda_layers"]),
              "layer_types does not agree with linear_attn_config's full_attn_layers / kda_layers")
    return extra_lin


def _read_rope(d: dict) -> None:
    """The rope settings into ``rope_theta`` and ``rope_scaling`` (None or YaRN's dict as DeepSeek-V3 / Kimi K2 write
    it). transformers 5 writes ``rope_parameters`` {rope_theta, rope_type, YaRN's keys}; k3's MLA rotates
    interleaved pairs, plainly or with YaRN: any other scaling would attend differently, so it is refused rather
    than ignored (by K3Config's check)."""
    params = dict(d.pop("rope_parameters", None) or {})
    theta = params.pop("rope_theta", None)
    scaling = d.get("rope_scaling") or {}
    kind = params.pop("rope_type", scaling.get("rope_type", scaling.get("type", "default")))
    if kind == "default":
        d["rope_scaling"] = None
    elif params:  # transformers 5's form -> the release's
        _need(not scaling or {k: v for k, v in scaling.items() if k not in ("type", "rope_type")} == params,
              "rope_scaling and rope_parameters disagree")
        d["rope_scaling"] = {"type": kind, **params}
    _need(d.pop("rope_interleave", True), "rope_interleave = false is not implemented: k3 rotates interleaved pairs, "
                                          "as DeepSeek-V3 and Kimi K2 do")
    _need(d.get("moe_layer_freq", 1) == 1, f"moe_layer_freq = {d.get('moe_layer_freq')}: k3 builds an MoE in every "
                                           "layer after the first_k_dense_replace dense ones (moe_layer_freq 1)")
    if theta is not None:
        _need(d.get("rope_theta", theta) == theta, "rope_theta and rope_parameters.rope_theta disagree")
        d["rope_theta"] = theta


def _check_derived(d: dict, kw: dict) -> None:
    """Keys transformers derives from others: they must agree, then they are dropped (written back on save)."""
    mlp_types = d.pop("mlp_layer_types", None)
    if mlp_types is not None:
        n = kw["num_hidden_layers"]
        k = sum(1 for _ in itertools.takewhile(lambda t: t == "dense", mlp_types))
        _need(len(mlp_types) == n and all(t == "sparse" for t in mlp_types[k:]),
              f"mlp_layer_types must be {n} entries, 'dense' layers first then 'sparse' (k3 builds dense layers only "
              f"before the MoE ones); got {mlp_types}")
        if "first_k_dense_replace" in d:
            _need(d["first_k_dense_replace"] == k, f"mlp_layer_types has {k} dense layers but first_k_dense_replace "
                                                   f"= {d['first_k_dense_replace']}")
        kw["first_k_dense_replace"] = k
    qk = d.pop("qk_head_dim", None)
    nope = d.get("qk_nope_head_dim", kw["qk_nope_head_dim"])
    rope = d.get("qk_rope_head_dim", kw["qk_rope_head_dim"])
    _need(qk is None or qk == nope + rope, f"qk_head_dim = {qk} but qk_nope_head_dim + qk_rope_head_dim = {nope + rope}")
    kv = d.pop("num_key_value_heads", None)
    heads = d.get("num_attention_heads", kw["num_attention_heads"])
    _need(kv is None or kv == heads, f"num_key_value_heads = {kv} but MLA has one latent shared by all "
                                     f"num_attention_heads = {heads} heads: they must be equal")


def read_hf(src: dict, cls, strict: bool = True) -> dict:
    """The K3Config keyword arguments for a config.json dict (see the module docstring)."""
    top = None
    if {"text_config", "vision_config"} & src.keys():
        if "text_config" not in src:
            raise ValueError("config has vision_config but no text_config: K3 needs the text model's fields")
        top = {k: v for k, v in src.items() if k != "text_config"}
        model_type = top.get("model_type")
        d = dict(src["text_config"])
    else:
        d = dict(src)
        model_type = d.get("model_type")
    kw = _defaults(model_type, cls)
    d = _resolve_aliases(d)
    _read_rope(d)
    for k in ("num_hidden_layers",):  # needed before the layer lists are read
        kw[k] = d.pop(k, kw[k])
    extra_lin = _read_linear(d, kw, model_type, strict)
    _check_derived(d, kw)
    block = d.pop("attn_res_block_size", None)
    kw["attn_res"] = d.pop("k3_attn_res", "block" if block else "none")
    if block:
        kw["attn_res_block_size"] = block
    kw["qat"] = d.pop("k3_qat", None)  # our extension: the quantisation the model trains with (SPEC §6)
    names = set(kw) - {"full_attn_layers", "kda_layers", "gate", "gate_lower_bound", "attn_res", "qat"}
    extra: dict[str, Any] = {}
    for k, v in d.items():
        if k in names:
            kw[k] = v
        elif k in _PASSTHROUGH:
            extra[k] = v
        elif strict:
            raise UnknownConfigField(f"unknown field {k!r} in the text config")
        else:
            extra[k] = v
    if extra_lin:
        extra["__linear_extra__"] = extra_lin
    if top is not None:
        for t in TOKEN_IDS:  # the text config's ids win; the wrapper's fill in
            v = top.pop(t, None)
            if t not in d and v is not None:
                kw[t] = v
    return {**kw, "extra": extra, "top_level": top}


def drop_generated(c: "K3Config") -> "K3Config":
    """``c`` without the carried keys whose values ``write_hf`` generates anyway (model_type, architectures,
    head_dim, ...), so that a file k3 wrote reads back as the config that wrote it."""
    bare = c.replace(extra={k: v for k, v in c.extra.items() if k == "__linear_extra__"}, top_level=None)
    out = write_hf(bare)
    text = out.get("text_config", out)
    wrapper = {k: v for k, v in out.items() if k != "text_config"} if "text_config" in out else {}
    extra = {k: v for k, v in c.extra.items() if not (k in _GENERATED and text.get(k) == v)}
    top = None
    if c.top_level is not None:
        gen = wrapper or {"model_type": KIMI_K3, "architectures": ARCHITECTURES[KIMI_K3]}
        top = {k: v for k, v in c.top_level.items() if not (k in _GENERATED and gen.get(k) == v)} or None
    return c.replace(extra=extra, top_level=top)


def _write_deepseek(c: "K3Config") -> dict:
    """DeepSeek-V3's config.json (Kimi K2's architecture), as transformers' DeepseekV3Config writes it."""
    d = {"model_type": DEEPSEEK_V3, "architectures": ARCHITECTURES[DEEPSEEK_V3], "vocab_size": c.vocab_size,
         "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
         "moe_intermediate_size": c.moe_intermediate_size, "num_hidden_layers": c.num_hidden_layers,
         "num_attention_heads": c.num_attention_heads, "num_key_value_heads": c.num_attention_heads,
         "n_routed_experts": c.num_experts, "num_experts_per_tok": c.num_experts_per_token,
         "n_shared_experts": c.num_shared_experts, "routed_scaling_factor": c.routed_scaling_factor,
         "norm_topk_prob": c.moe_renormalize, "n_group": c.num_expert_group, "topk_group": c.topk_group,
         "first_k_dense_replace": c.first_k_dense_replace, "kv_lora_rank": c.kv_lora_rank,
         "q_lora_rank": c.q_lora_rank, "qk_rope_head_dim": c.qk_rope_head_dim, "qk_nope_head_dim": c.qk_nope_head_dim,
         "v_head_dim": c.v_head_dim, "qk_head_dim": c.qk_head_dim, "head_dim": c.qk_rope_head_dim,
         "hidden_act": c.hidden_act, "max_position_embeddings": c.max_position_embeddings,
         "rms_norm_eps": c.rms_norm_eps, "rope_theta": c.rope_theta, "rope_interleave": True,
         "rope_scaling": c.rope_scaling,
         "tie_word_embeddings": c.tie_word_embeddings, "num_nextn_predict_layers": c.num_nextn_predict_layers,
         **{t: getattr(c, t) for t in TOKEN_IDS}}
    d.update({k: v for k, v in c.extra.items() if k != "__linear_extra__"})
    return d if c.top_level is None else {**c.top_level, "text_config": d}


def write_hf(c: "K3Config") -> dict:
    """The config.json of ``c`` in its layout (``hf_layout``)."""
    layout = hf_layout(c)
    if layout == DEEPSEEK_V3:
        return _write_deepseek(c)
    d: dict[str, Any] = {"model_type": KIMI_LINEAR, "architectures": ARCHITECTURES[KIMI_LINEAR]}
    skip = {"extra", "top_level", "full_attn_layers", "kda_layers", "kda_num_heads", "kda_head_dim",
            "short_conv_kernel_size", "gate", "gate_lower_bound", "use_full_rank_gate", "attn_res",
            "attn_res_block_size", "qat"}
    for f in dataclasses.fields(c):
        if f.name not in skip and not (f.name == "rope_scaling" and c.rope_scaling is None):
            d[f.name] = getattr(c, f.name)
    d["num_key_value_heads"] = c.num_attention_heads
    lin = {"num_heads": c.kda_num_heads, "head_dim": c.kda_head_dim, "short_conv_kernel_size": c.short_conv_kernel_size,
           "full_attn_layers": list(c.full_attn_layers), "kda_layers": list(c.kda_layers)}
    if c.gate == "lower_bound":
        lin["gate_lower_bound"] = c.gate_lower_bound
    lin["use_full_rank_gate"] = c.use_full_rank_gate
    lin.update(c.extra.get("__linear_extra__") or {})
    d["linear_attn_config"] = lin  # also for all-MLA models, so that the KDA settings round-trip
    if c.attn_res != "none":
        d["attn_res_block_size"] = c.attn_res_block_size
    if c.attn_res == "full":
        d["k3_attn_res"] = "full"  # our extension; the official checkpoint uses blocks
    if c.qat is not None:
        d["k3_qat"] = c.qat  # our extension: the scheme the model trains (and runs unpacked) with
    if layout == KIMI_LINEAR:  # what transformers' KimiLinearConfig and mlx-lm's kimi_linear reader require
        d["model_max_length"] = d.pop("max_position_embeddings")
        d["linear_num_heads"], d["linear_head_dim"] = c.kda_num_heads, c.kda_head_dim
        d["linear_conv_kernel_dim"] = c.short_conv_kernel_size
        d["head_dim"] = c.qk_rope_head_dim
        d["qk_head_dim"] = c.qk_head_dim
        d["layer_types"] = ["full_attention" if c.layer_kind(i) == "mla" else "linear_attention"
                            for i in range(c.num_hidden_layers)]
        d["mlp_layer_types"] = ["sparse" if c.is_moe_layer(i) else "dense" for i in range(c.num_hidden_layers)]
    d.update({k: v for k, v in c.extra.items() if k != "__linear_extra__"})
    if layout == KIMI_LINEAR and c.top_level is None:
        return d
    top = {"model_type": KIMI_K3, "architectures": ARCHITECTURES[KIMI_K3], **{t: d[t] for t in TOKEN_IDS}}
    # quantization_config says how the tensors written are stored (save_pretrained puts it in ``extra`` when the
    # experts are packed): at the top level of a nested config, where transformers and vLLM read it; one read
    # from a release is never carried over from ``top_level``
    qc = d.pop("quantization_config", None)
    out = {**top, **{k: v for k, v in (c.top_level or {}).items() if k != "quantization_config"}, "text_config": d}
    return out if qc is None else {**out, "quantization_config": qc}
