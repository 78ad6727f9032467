"""Parameter accounting: total and active parameters by component, built on the meta device (no memory), and the
bytes a model's tensors hold by component (with routed experts packed, SPEC §6: 4.25 bits per weight).

Active = what one token touches: everything except the input embedding, the routed experts it was not
sent to (only k of E count), MTP layers and the vision tower (SPEC §1's convention). A training step's MTP loss
multiplies more per token: ``mtp_active`` counts it (each MTP layer's parameters, k of E routed experts, and its
pass through the shared LM head), for training FLOPs (benchmarks/bench_train.py).
"""

from __future__ import annotations

import itertools

import torch

from ..config import K3Config

COMPONENTS = ("embedding", "kda", "mla", "dense_ffn", "routed_experts", "shared_experts", "latent_proj", "router",
              "attn_res", "norms", "head", "mtp")

# What the report states (SPEC §1), printed beside our counts.
REPORTED = {"kimi-k3": {"total": 2779.5e9, "active": 104.19e9}, "kimi-k2": {"total": 1026e9, "active": 32.6e9}}


def component(name: str, kinds: dict[int, str]) -> str:
    if name.startswith("mtp."):
        return "mtp"
    if name.startswith("model.embed_tokens"):
        return "embedding"
    if name.startswith("lm_head"):
        return "head"
    if "_res_proj" in name or "_res_norm" in name:
        return "attn_res"
    if name.endswith("norm.weight") or "layernorm" in name:
        return "norms"
    if ".experts." in name:
        return "routed_experts"
    if ".shared_experts." in name:
        return "shared_experts"
    if "routed_expert_down_proj" in name or "routed_expert_up_proj" in name:
        return "latent_proj"
    if ".gate." in name:
        return "router"
    if ".mlp." in name:
        return "dense_ffn"
    if ".self_attn." in name:
        return kinds[int(name.split(".")[2])]
    raise ValueError(f"parameter {name} belongs to no component")


def count_parameters(config: K3Config) -> dict:
    """{"total": int, "active": int, "mtp_active": int, "by_component": {name: {"total": int, "active": int}}}."""
    from .transformer import K3ForCausalLM

    with torch.device("meta"):
        model = K3ForCausalLM(config)
    kinds = {i: config.layer_kind(i) for i in range(config.num_hidden_layers)}
    frac = config.num_experts_per_token / max(config.num_experts, 1)
    by = {c: {"total": 0, "active": 0} for c in COMPONENTS}
    mtp_active = config.num_nextn_predict_layers * config.vocab_size * config.hidden_size  # the shared head, again
    for name, p in model.named_parameters():  # tied weights are yielded once
        c, n = component(name, kinds), p.numel()
        by[c]["total"] += n
        if c == "mtp":
            mtp_active += round(n * frac) if ".experts." in name else n
        if c in ("embedding", "mtp"):
            continue
        by[c]["active"] += round(n * frac) if c == "routed_experts" else n
    if config.tie_word_embeddings:  # the head IS the embedding: it is active even though the lookup is not
        by["head"]["active"] += by["embedding"]["total"]
    total = sum(v["total"] for v in by.values())
    active = sum(v["active"] for v in by.values())
    return {"total": total, "active": active, "mtp_active": mtp_active, "by_component": by}


def count_bytes(model) -> dict[str, int]:
    """Bytes of every parameter and buffer of ``model`` by component, in the dtypes it holds (meta tensors count
    too): packed experts count their uint8 codes and scales."""
    config = model.config
    kinds = {i: config.layer_kind(i) for i in range(config.num_hidden_layers)}
    by = dict.fromkeys(COMPONENTS, 0)
    for name, t in itertools.chain(model.named_parameters(), model.named_buffers()):
        by[component(name, kinds)] += t.numel() * t.element_size()
    return by


def memory_summary(model) -> str:
    """One line: the bytes of the model's tensors, the routed experts' share (MTP's included) and their bits per
    weight."""
    named = list(itertools.chain(model.named_parameters(), model.named_buffers()))
    total = sum(t.numel() * t.element_size() for _, t in named)
    experts = [(n, t) for n, t in named if ".experts." in n]
    held = sum(t.numel() * t.element_size() for _, t in experts)
    weights = sum(2 * t.numel() if n.endswith(".weight_packed") else t.numel() for n, t in experts
                  if not n.endswith(".weight_scale"))
    packed = any(n.endswith(".weight_packed") for n, _ in experts)
    bits = f", {8 * held / weights:.2f} bits/weight" if weights else ""
    return (f"model memory {_size(total)}: routed experts {_size(held)} ({'MXFP4 packed' if packed else 'unpacked'}"
            f"{bits}), the rest {_size(total - held)}")


def _size(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.2f} MiB"
