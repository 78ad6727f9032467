"""Reading and writing K3 checkpoints (see the package docstring for the name translation)."""

from __future__ import annotations

import json
import os
import re
import tempfile
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from ..config import K3Config
from ..ops.mx import dequantize_mxfp4

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
_SKIP_PREFIXES = ("vision_tower.", "mm_projector.", "multi_modal_projector.")
_EXPERT = re.compile(r"^(.*\.experts)\.(\d+)\.(w[123])\.(weight|weight_packed|weight_scale)$")
_MTP_OUT = re.compile(r"^mtp\.(\d+)\.(block\.)?(.*)$")


class CheckpointError(RuntimeError):
    pass


def to_hf_state_dict(state: dict[str, torch.Tensor], config: K3Config) -> dict[str, torch.Tensor]:
    out = {}
    L = config.num_hidden_layers
    for name, t in state.items():
        if config.tie_word_embeddings and name == "lm_head.weight":
            continue
        m = _MTP_OUT.match(name)
        if m:
            name = f"model.layers.{L + int(m.group(1))}.{m.group(3)}"
        m = re.search(r"\.experts\.(w[123])(\.weight_packed|\.weight_scale)?$", name)
        if m:  # a bank [E, ...] (packed: two tensors) -> one tensor per expert
            base, w, kind = name[:m.start()] + ".experts", m.group(1), m.group(2) or ".weight"
            for e in range(t.shape[0]):
                out[f"{base}.{e}.{w}{kind}"] = t[e]
            continue
        out[name] = t
    return out


def from_hf_state_dict(hf: dict[str, torch.Tensor], config: K3Config, dtype=None,
                       keep_packed: bool = False) -> tuple[dict, list[str]]:
    """HF tensors -> our state dict. Returns (state, skipped names). MXFP4 experts are dequantised, or with
    ``keep_packed`` stacked as ``...experts.w{n}.weight_packed`` / ``.weight_scale`` [E, ...]."""
    L, skipped = config.num_hidden_layers, []
    if dtype is None:  # one dtype for the model: the embedding's (MXFP4 experts are dequantised to it)
        emb = hf.get("model.embed_tokens.weight", hf.get("language_model.model.embed_tokens.weight"))
        dtype = emb.dtype if emb is not None else torch.bfloat16
    mtp_stems = {"enorm", "hnorm", "eh_proj", "shared_head"}
    experts: dict[tuple[str, str], dict[int, torch.Tensor]] = {}
    packed: dict[str, dict[str, torch.Tensor]] = {}
    state = {}
    for name, t in hf.items():
        if name.startswith("language_model."):
            name = name[len("language_model."):]
        if name.startswith(_SKIP_PREFIXES):
            skipped.append(name)
            continue
        name = re.sub(r"_res\.proj_weight$", "_res_proj.weight", name)
        name = re.sub(r"_res\.norm_weight$", "_res_norm.weight", name)
        m = re.match(r"^model\.layers\.(\d+)\.(.*)$", name)
        if m and int(m.group(1)) >= L:
            i, rest = int(m.group(1)) - L, m.group(2)
            if rest.startswith("shared_head.head"):
                skipped.append(name)  # the MTP head is the shared lm_head
                continue
            name = f"mtp.{i}.{rest}" if rest.split(".")[0] in mtp_stems else f"mtp.{i}.block.{rest}"
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
            raise CheckpointError(f"{base}.{w}: expected experts 0..{E - 1}, missing {missing[:8]}")
        state[f"{base}.{w}"] = torch.stack([per[e] for e in range(E)])
    for name in [n for n in state if n.endswith(".A_log")]:
        a, H = state[name].reshape(-1), config.kda_num_heads
        if a.numel() > H:
            if bool((a[H:] != 0).any()):
                raise CheckpointError(f"{name}: {a.numel()} entries for {H} heads and the padding is not zero")
            a = a[:H]
        state[name] = a
    state = {k: (v.to(dtype) if v.is_floating_point() and not _keep_fp32(k) else v) for k, v in state.items()}
    return state, skipped


def _keep_fp32(name: str) -> bool:
    return name.endswith(("A_log", "dt_bias", "e_score_correction_bias"))


def _atomic_save(tensors: dict, path: Path, metadata: dict | None = None) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        save_file({k: v.contiguous() for k, v in tensors.items()}, tmp, metadata=metadata)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _atomic_write_text(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def save_pretrained(model, directory: str | Path, max_shard_bytes: int = 5 * 2**30, state: dict | None = None,
                    quantization: str | None = None) -> None:
    """Write config.json and the weights in HF naming; shards + ``model.safetensors.index.json`` when the
    weights exceed ``max_shard_bytes``. Every file is written to a temp name and renamed into place.
    ``state``: the full state dict to write instead of ``model.state_dict()`` (e.g. gathered from FSDP shards).
    ``quantization="mxfp4"``: routed experts in the release's packed layout (k3.quant.export) with its
    ``quantization_config``; a model that already keeps its experts packed is written packed either way."""
    from ..quant.export import is_packed_state, pack_expert_state, quantization_config

    if quantization not in (None, "mxfp4"):
        raise ValueError(f"save_pretrained(quantization=...) must be None or 'mxfp4'; got {quantization!r}")
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().cpu() for k, v in (model.state_dict() if state is None else state).items()}
    if quantization == "mxfp4":
        state = pack_expert_state(state)
    hf = to_hf_state_dict(state, model.config)
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
    if len(shards) == 1:
        _atomic_save(shards[0], d / SINGLE, meta)
        (d / INDEX).unlink(missing_ok=True)
    else:
        weight_map, total = {}, 0
        for i, shard in enumerate(shards):
            fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            _atomic_save(shard, d / fname, meta)
            for k, v in shard.items():
                weight_map[k] = fname
                total += v.numel() * v.element_size()
        _atomic_write_text(d / INDEX, json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
        (d / SINGLE).unlink(missing_ok=True)
    # quantization_config describes the tensors written: there when the experts are packed, dropped when not (a
    # release checkpoint loaded dequantised and saved again is plain bf16/fp32)
    extra = {k: v for k, v in model.config.extra.items() if k != "quantization_config"}
    if is_packed_state(state):
        extra["quantization_config"] = quantization_config()
    config = model.config.replace(extra=extra)
    _atomic_write_text(d / "config.json", json.dumps(config.to_hf(), indent=2) + "\n")


def read_hf_tensors(directory: str | Path) -> dict[str, torch.Tensor]:
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


def load_pretrained(directory: str | Path, config: K3Config | None = None, dtype=None, device="cpu",
                    strict: bool = True, keep_packed: bool = False):
    """Build a K3ForCausalLM from a checkpoint directory (ours or the official layout). ``keep_packed``: serve the
    routed experts packed (MXFP4, k3.quant.PackedExpertBank); float experts in the checkpoint are quantised on
    load (post-training quantisation)."""
    from ..model.transformer import K3ForCausalLM
    from ..quant import pack_expert_state, pack_experts

    config = config or K3Config.from_hf(directory)
    state, skipped = from_hf_state_dict(read_hf_tensors(directory), config, dtype, keep_packed=keep_packed)
    if keep_packed:
        state = pack_expert_state(state)
    with torch.device("meta"):
        model = K3ForCausalLM(config)
    if keep_packed:
        pack_experts(model, quantize=False)
    expected = model.state_dict()
    if config.tie_word_embeddings:
        expected.pop("lm_head.weight", None)
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if strict and (missing or unexpected):
        raise CheckpointError(f"checkpoint does not match the config: missing {missing[:10]}"
                              f"{' ...' if len(missing) > 10 else ''}; unexpected {unexpected[:10]}"
                              f"{' ...' if len(unexpected) > 10 else ''}")
    bad = [f"{k}: checkpoint {tuple(state[k].shape)} vs model {tuple(expected[k].shape)}"
           for k in expected if k in state and state[k].shape != expected[k].shape]
    if bad:
        raise CheckpointError("shape mismatch (a checkpoint of another config?): " + "; ".join(bad[:10]))
    model.load_state_dict({k: v.to(device) for k, v in state.items()}, strict=False, assign=True)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    leftover = [n for n, p in list(model.named_parameters()) + list(model.named_buffers()) if p.is_meta]
    if leftover:
        raise CheckpointError(f"parameters not in the checkpoint: {leftover[:10]}")
    model.skipped_weights = skipped
    return model
