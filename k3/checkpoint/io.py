"""Reading and writing K3 checkpoints (see the package docstring for the name translation)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from ..atomic import atomic_path, write_text_atomic
from ..config import K3Config
from .errors import CheckpointError
from .manifest import forget_checksums, record_checksums, verify_checksums
from .mxfp4 import dequantize_mxfp4

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
CONFIG = "config.json"
_SKIP_PREFIXES = ("vision_tower.", "mm_projector.", "multi_modal_projector.")
_EXPERT = re.compile(r"^(.*\.experts)\.(\d+)\.(w[123])\.(weight|weight_packed|weight_scale)$")
_MTP_OUT = re.compile(r"^mtp\.(\d+)\.(block\.)?(.*)$")


def to_hf_state_dict(state: dict[str, torch.Tensor], config: K3Config) -> dict[str, torch.Tensor]:
    out = {}
    L = config.num_hidden_layers
    for name, t in state.items():
        if config.tie_word_embeddings and name == "lm_head.weight":
            continue
        m = _MTP_OUT.match(name)
        if m:
            name = f"model.layers.{L + int(m.group(1))}.{m.group(3)}"
        if re.search(r"\.experts\.w[123]$", name):
            base, w = name.rsplit(".", 1)
            for e in range(t.shape[0]):
                out[f"{base}.{e}.{w}.weight"] = t[e]
            continue
        out[name] = t
    return out


def from_hf_state_dict(hf: dict[str, torch.Tensor], config: K3Config, dtype=None) -> tuple[dict, list[str]]:
    """HF tensors -> our state dict. Returns (state, skipped names)."""
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
        experts.setdefault((base, w), {})[int(e)] = dequantize_mxfp4(parts["weight_packed"], parts["weight_scale"], dtype)
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
    with atomic_path(path) as tmp:
        save_file({k: v.contiguous() for k, v in tensors.items()}, tmp, metadata=metadata)


def save_pretrained(model, directory: str | Path, max_shard_bytes: int = 5 * 2**30, state: dict | None = None) -> None:
    """Write config.json and the weights in HF naming; shards + ``model.safetensors.index.json`` when the
    weights exceed ``max_shard_bytes``. Every file is written to a temp name and renamed into place, and their
    sha256 sums into ``SHA256SUMS`` last (see manifest.py).
    ``state``: the full state dict to write instead of ``model.state_dict()`` (e.g. gathered from FSDP shards)."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    state = model.state_dict() if state is None else state
    hf = to_hf_state_dict({k: v.detach().cpu() for k, v in state.items()}, model.config)
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
    forget_checksums(d, names + [CONFIG])
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
    write_text_atomic(d / CONFIG, json.dumps(model.config.to_hf(), indent=2) + "\n")
    record_checksums(d, names + [CONFIG])


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


def load_pretrained(directory: str | Path, config: K3Config | None = None, dtype=None, device="cpu",
                    strict: bool = True, verify: bool = True):
    """Build a K3ForCausalLM from a checkpoint directory (ours or the official layout). ``verify``: check the
    files read against the directory's SHA256SUMS (when it has one) and name any that differ."""
    from ..model.transformer import K3ForCausalLM

    if verify:
        verify_checksums(directory, [CONFIG])
    config = config or K3Config.from_hf(directory)
    state, skipped = from_hf_state_dict(read_hf_tensors(directory, verify), config, dtype)
    with torch.device("meta"):
        model = K3ForCausalLM(config)
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
