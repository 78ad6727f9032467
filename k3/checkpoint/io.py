"""Reading and writing K3 checkpoints as state dicts (see the package docstring for the name translation).

Names, shards and checksums only: no model is built here (k3.pretrained builds one from what this reads).
"""

from __future__ import annotations

import json
import re
import warnings
from pathlib import Path
from typing import NamedTuple

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from ..atomic import atomic_path, write_text_atomic
from ..config import K3Config
from ..ops.mx import dequantize_mxfp4
from .errors import CheckpointError, check_finite
from .manifest import forget_checksums, record_checksums, verify_checksums
from .multimodal import TEXT_PREFIX, VISION_PREFIXES, is_vision, split_text, vision_state

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
CONFIG, GENERATION = "config.json", "generation_config.json"
_EXPERT = re.compile(r"^(.*\.experts)\.(\d+)\.(w[123])\.(weight|weight_packed|weight_scale)$")
_MTP_OUT = re.compile(r"^mtp\.(\d+)\.(block\.)?(.*)$")
_MTP_IN = re.compile(r"^model\.mtp\.(?:layers\.)?(\d+)\.(.*)$")  # model.mtp.layers.{i}.* / model.mtp.{i}.*
_MTP_STEMS = {"enorm", "hnorm", "eh_proj", "shared_head"}
_DEEPSEEK_EXPERT = {"gate": "w1", "down": "w2", "up": "w3"}  # DeepSeek-V3's expert projections -> Kimi's names


def to_hf_state_dict(state: dict[str, torch.Tensor], config: K3Config) -> dict[str, torch.Tensor]:
    """Our state dict -> the checkpoint's names and shapes for ``config.hf_layout`` (Kimi Linear keeps ``A_log``
    as [1, 1, H, 1], the shape transformers' and mlx-lm's Kimi Linear modules hold; K3's is [H]; DeepSeek-V3's
    layout names the MoE ``mlp`` and its experts ``gate_proj`` / ``up_proj`` / ``down_proj``)."""
    out = {}
    L = config.num_hidden_layers
    layout = config.hf_layout
    a_log_shape = (1, 1, -1, 1) if layout == "kimi_linear" else (-1,)
    deepseek = {v: k for k, v in _DEEPSEEK_EXPERT.items()} if layout == "deepseek_v3" else None
    for name, t in state.items():
        if config.tie_word_embeddings and name == "lm_head.weight":
            continue
        m = _MTP_OUT.match(name)
        if m:
            name = f"model.layers.{L + int(m.group(1))}.{m.group(3)}"
        if deepseek is not None:  # DeepseekV3ForCausalLM: the MoE under mlp., experts as gate/up/down_proj
            name = name.replace(".block_sparse_moe.", ".mlp.")
        m = re.search(r"\.experts\.(w[123])(\.weight_packed|\.weight_scale)?$", name)
        if m:  # a bank [E, ...] (packed MXFP4: two tensors) -> one tensor per expert
            base, w, kind = name[:m.start()] + ".experts", m.group(1), m.group(2) or ".weight"
            for e in range(t.shape[0]):
                out[f"{base}.{e}.{w}{kind}" if deepseek is None else f"{base}.{e}.{deepseek[w]}_proj{kind}"] = t[e]
            continue
        if name.endswith(".A_log"):
            t = t.reshape(a_log_shape)
        out[name] = t
    return out


def _our_name(name: str, config: K3Config) -> str | None:
    """A checkpoint tensor's name in our module tree, or None for a tensor the text model does not use."""
    if name.startswith(TEXT_PREFIX):
        name = name[len(TEXT_PREFIX):]
    if name.startswith(VISION_PREFIXES):
        return None
    name = re.sub(r"_res\.(proj|norm)_weight$", r"_res_\1.weight", name)  # the dotted AttnRes form
    # the router bias beside the router instead of in it
    name = re.sub(r"\.block_sparse_moe\.e_score_correction_bias$", ".block_sparse_moe.gate.e_score_correction_bias", name)
    L = config.num_hidden_layers
    m = _MTP_IN.match(name)
    if m:  # MTP stored apart from the trunk's layers
        name = f"model.layers.{L + int(m.group(1))}.{m.group(2)}"
    m = re.match(r"^model\.layers\.(\d+)\.(.*)$", name)
    if not m:
        return name
    i, rest = int(m.group(1)), m.group(2)
    if i >= L:
        if rest.startswith("shared_head.head"):
            return None  # the MTP head is the shared lm_head
        return f"mtp.{i - L}.{rest}" if rest.split(".")[0] in _MTP_STEMS else f"mtp.{i - L}.block.{rest}"
    if not config.is_moe_layer(i) and re.match(r"^block_sparse_moe\.(gate|up|down)_proj\.weight$", rest):
        rest = "mlp." + rest[len("block_sparse_moe."):]  # transformers re-saves a dense layer's MLP under the MoE name
    if config.is_moe_layer(i) and rest.startswith("mlp."):  # DeepSeek-V3's names (Kimi K2, K2.5)
        rest = "block_sparse_moe." + rest[len("mlp."):]
        rest = re.sub(r"\.experts\.(\d+)\.(gate|up|down)_proj\.", lambda m: f".experts.{m.group(1)}."
                      f"{_DEEPSEEK_EXPERT[m.group(2)]}.", rest)
    return f"model.layers.{i}.{rest}"


def _gate_param(name: str, t: torch.Tensor, config: K3Config) -> torch.Tensor:
    """``A_log`` as [H] and ``dt_bias`` as [H*K], whatever shape the checkpoint stores them in: [1, 1, H, 1]
    (Kimi Linear), [H, K], or ``A_log`` padded beyond the head count (the K3 release ships 128 entries for 96
    heads; the entries past the heads belong to no head, and every reader takes the first H)."""
    H, K = config.kda_num_heads, config.kda_head_dim
    flat = t.reshape(-1)
    if name.endswith(".A_log"):
        if flat.numel() < H:
            raise CheckpointError(f"{name} has {flat.numel()} entries of shape {tuple(t.shape)}; expected one per KDA "
                                  f"head (linear_attn_config.num_heads = {H})")
        return flat[:H]
    if flat.numel() != H * K:
        raise CheckpointError(f"{name} has shape {tuple(t.shape)}; expected {H * K} values (num_heads {H} x head_dim "
                              f"{K}), as [{H * K}] or [{H}, {K}]")
    return flat


def from_hf_state_dict(hf: dict[str, torch.Tensor], config: K3Config, dtype=None,
                       keep_packed: bool = False) -> tuple[dict, list[str]]:
    """HF tensors -> our state dict. Returns (state, names of the tensors the text model does not use). MXFP4
    experts are dequantised, or with ``keep_packed`` stacked as ``...experts.w{n}.weight_packed`` /
    ``.weight_scale`` [E, ...]."""
    skipped = []
    if dtype is None:  # one dtype for the model: the embedding's (MXFP4 experts are dequantised to it)
        emb = hf.get("model.embed_tokens.weight", hf.get("language_model.model.embed_tokens.weight"))
        dtype = emb.dtype if emb is not None else torch.bfloat16
    experts: dict[tuple[str, str], dict[int, torch.Tensor]] = {}
    packed: dict[str, dict[str, torch.Tensor]] = {}
    state = {}
    for original, t in hf.items():
        name = _our_name(original, config)
        if name is None:
            skipped.append(original)
            continue
        m = _EXPERT.match(name)
        if m:
            base, e, w, kind = m.group(1), int(m.group(2)), m.group(3), m.group(4)
            if kind == "weight":
                experts.setdefault((base, w), {})[e] = t
            else:
                packed.setdefault(f"{base}|{w}|{e}", {})[kind] = t
            continue
        if name.endswith("_res_proj.weight") and t.dim() == 1:
            t = t.view(1, -1)
        if name.endswith((".A_log", ".dt_bias")):
            t = _gate_param(name, t, config)
        if name in state:
            raise CheckpointError(f"{original} and another tensor both map to {name}: the checkpoint holds the same "
                                  "weight under two names (e.g. its MTP layer as model.layers.N and model.mtp)")
        state[name] = t
    for key, parts in packed.items():
        base, w, e = key.split("|")
        if set(parts) != {"weight_packed", "weight_scale"}:
            raise CheckpointError(f"{base}.{e}.{w}: MXFP4 needs weight_packed and weight_scale; found {sorted(parts)}")
        if keep_packed:
            for kind, t in parts.items():
                experts.setdefault((base, f"{w}.{kind}"), {})[int(e)] = t
        else:
            experts.setdefault((base, w), {})[int(e)] = dequantize_mxfp4(parts["weight_packed"], parts["weight_scale"],
                                                                         dtype)
    for (base, w), per in experts.items():
        E = config.num_experts
        if sorted(per) != list(range(E)):
            missing = sorted(set(range(E)) - set(per))
            raise CheckpointError(f"{base}.{w}: expected experts 0..{E - 1} (num_experts = {E}), missing "
                                  f"{missing[:8]}, unexpected {sorted(set(per) - set(range(E)))[:8]}")
        state[f"{base}.{w}"] = torch.stack([per[e] for e in range(E)])
    state = {k: (v.to(dtype) if v.is_floating_point() and not _keep_fp32(k) else v) for k, v in state.items()}
    return state, skipped


def _keep_fp32(name: str) -> bool:
    return name.endswith(("A_log", "dt_bias", "e_score_correction_bias"))


def _atomic_save(tensors: dict, path: Path, metadata: dict | None = None) -> None:
    with atomic_path(path) as tmp:
        save_file({k: v.contiguous() for k, v in tensors.items()}, tmp, metadata=metadata)


def write_checkpoint(directory: str | Path, state: dict[str, torch.Tensor], config: K3Config,
                     max_shard_bytes: int = 5 * 2**30, quantization_config: dict | None = None) -> None:
    """Write ``state`` (our names, on the CPU) as config.json + safetensors in HF naming; shards +
    ``model.safetensors.index.json`` when the weights exceed ``max_shard_bytes``. Every file is written to a temp
    name and renamed into place, and their sha256 sums into ``SHA256SUMS`` last (see manifest.py).
    ``quantization_config``: written into config.json (the tensors are packed, k3.quant.export); None drops it.
    A multimodal state (text weights under ``language_model.``) is written in the release's multimodal layout: the
    text weights translated as a text model's, the vision tensors as they are named."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    parts = split_text(state)
    if parts is None:
        hf = to_hf_state_dict(state, config)
    else:
        hf = {TEXT_PREFIX + k: v for k, v in to_hf_state_dict(parts[0], config).items()} | parts[1]
    # tensors that share storage (the per-expert views of one 3-D tensor) must be saved as separate copies
    hf = {k: v.clone() if v.storage_offset() or not v.is_contiguous() else v for k, v in hf.items()}
    shards: list[dict] = [{}]
    size = 0
    for name in sorted(hf):
        n = hf[name].numel() * hf[name].element_size()
        if shards[-1] and size + n > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = hf[name]
        size += n
    meta = {"format": "pt"}
    names = [SINGLE] if len(shards) == 1 else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
                                               for i in range(len(shards))] + [INDEX]
    forget_checksums(d, names + [CONFIG, GENERATION])
    if len(shards) == 1:
        _atomic_save(shards[0], d / SINGLE, meta)
        (d / INDEX).unlink(missing_ok=True)
    else:
        weight_map, total = {}, 0
        for fname, shard in zip(names, shards):
            _atomic_save(shard, d / fname, meta)
            for k, v in shard.items():
                weight_map[k] = fname
                total += v.numel() * v.element_size()
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        write_text_atomic(d / INDEX, json.dumps(index, indent=2))
        (d / SINGLE).unlink(missing_ok=True)
    # quantization_config describes the tensors written: there when the experts are packed, dropped when not (a
    # release checkpoint loaded dequantised and saved again is plain bf16/fp32)
    extra = {k: v for k, v in config.extra.items() if k != "quantization_config"}
    if quantization_config is not None:
        extra["quantization_config"] = quantization_config
    c = config.replace(extra=extra)
    write_text_atomic(d / CONFIG, json.dumps(c.to_hf(), indent=2) + "\n")
    written = names + [CONFIG]
    if c.eos_token_id is not None:  # where transformers' generate and mlx-lm read the ids that end generation
        gen = {"bos_token_id": c.bos_token_id, "eos_token_id": c.eos_token_id, "pad_token_id": c.pad_token_id}
        write_text_atomic(d / GENERATION, json.dumps(gen, indent=2) + "\n")
        written.append(GENERATION)
    else:
        (d / GENERATION).unlink(missing_ok=True)
    record_checksums(d, written)


def read_hf_tensors(directory: str | Path, verify: bool = True) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint's safetensors files; ``verify`` first checks them against SHA256SUMS."""
    d = Path(directory)
    files = []
    if (d / INDEX).exists():
        try:
            index = json.loads((d / INDEX).read_text())
            files = sorted(set(index["weight_map"].values()))
        except (json.JSONDecodeError, KeyError) as e:
            raise CheckpointError(f"{d / INDEX} is not a valid safetensors index: {e}") from None
    elif (d / SINGLE).exists():
        files = [SINGLE]
    else:
        raise CheckpointError(f"no {SINGLE} or {INDEX} in {d}: not a checkpoint directory")
    if verify:
        verify_checksums(d, [INDEX, *files])
    tensors = {}
    for f in files:
        p = d / f
        if not p.exists():
            raise CheckpointError(f"{p} is listed in the index but missing")
        try:
            tensors.update(load_file(p))
        except (SafetensorError, OSError, ValueError) as e:
            raise CheckpointError(f"{p} could not be read (truncated or corrupt?): {e}") from None
    return tensors


def mismatch_message(config: K3Config, missing: list[str], unexpected: list[str]) -> str:
    """What a state dict whose names differ from the model's is missing and has extra, with the config's reading of
    the first layer concerned."""
    missing, unexpected = ([n.removeprefix(TEXT_PREFIX) for n in names] for names in (missing, unexpected))

    def few(names):
        return f"{names[:8]}{' ...' if len(names) > 8 else ''}"

    hint = ""
    layers = {int(m.group(1)) for n in missing + unexpected if (m := re.match(r"model\.layers\.(\d+)\.", n))}
    if layers:
        i = min(layers)
        kind = "MoE" if config.is_moe_layer(i) else "dense"
        hint = (f"; the config builds layer {i} as {config.layer_kind(i).upper()} attention + {kind} FFN "
                f"(full_attn_layers, first_k_dense_replace = {config.first_k_dense_replace}, "
                f"latent MoE {'on' if config.latent_moe else 'off'}, MLA output gate "
                f"{'on' if config.mla_use_output_gate else 'off'}, AttnRes {config.attn_res})")
    return (f"checkpoint does not match its config.json: missing {few(missing)}; unexpected {few(unexpected)}{hint}. "
            "A checkpoint of another model, or a config.json that does not describe these weights?")


class Checkpoint(NamedTuple):
    config: K3Config  # the model's configuration (quantization_config dropped: the modules describe the model)
    state: dict[str, torch.Tensor]  # our names; a multimodal model's text weights under ``language_model.``
    skipped: list[str]  # checkpoint tensors the model read does not use
    vision: bool  # the state holds the vision tower and projector too


def read_checkpoint(directory: str | Path, config: K3Config | None = None, dtype=None, verify: bool = True,
                    keep_packed: bool = False, vision: bool | None = False) -> Checkpoint:
    """A checkpoint directory (k3's, the K3 release, or a Kimi Linear checkpoint written by transformers) as our
    state dict. ``verify``: check the files read against the directory's SHA256SUMS (when it has one) and name any
    that differ. ``keep_packed``: MXFP4 experts stay packed (stacked ``weight_packed`` / ``weight_scale``).
    ``vision``: True reads the vision tower and projector as well (the config.json must have a
    ``vision_config``); False reads the text model alone (vision tensors are listed in ``skipped``); None: as the
    config.json says. Which model class to build from it is k3.pretrained's choice."""
    if verify:
        verify_checksums(directory, [CONFIG])
    config = config or K3Config.from_hf(directory)
    has_vision = bool((config.top_level or {}).get("vision_config"))
    if vision is None:
        vision = has_vision
    elif vision and not has_vision:
        raise CheckpointError(f"{directory}: config.json has no vision_config: a text-only checkpoint; load it "
                              "as K3ForCausalLM, or give the config of a multimodal model")
    hf = read_hf_tensors(directory, verify)
    state, skipped = from_hf_state_dict(hf, config, dtype, keep_packed=keep_packed)
    if "quantization_config" in config.extra:  # the model in memory is described by its modules, not this
        config = config.replace(extra={k: v for k, v in config.extra.items() if k != "quantization_config"})
    if config.num_nextn_predict_layers and not any(k.startswith("mtp.") for k in state):
        # DeepSeek-V3's config declares an MTP layer that transformers neither builds nor saves
        warnings.warn(f"{directory}: config.json declares {config.num_nextn_predict_layers} MTP layer(s) but the "
                      "checkpoint has no MTP weights; loading the model without MTP", stacklevel=3)
        config = config.replace(num_nextn_predict_layers=0)
    if vision:
        towers = vision_state(hf, state["model.embed_tokens.weight"].dtype)
        state = {TEXT_PREFIX + k: v for k, v in state.items()} | towers
        skipped = [n for n in skipped if not is_vision(n)]
    check_finite(state, directory)
    return Checkpoint(config, state, skipped, vision)
