"""k3 params: total and active parameters by component, counted on the meta device; with a vision tower (the
config's ``vision_config``, or ``--vision PRESET``), its tower and projector on rows of their own, outside the text
model's total and active (SPEC §1's convention)."""

from __future__ import annotations

import json

from ..model.params import COMPONENTS, REPORTED, count_bytes, count_parameters
from ..vision.config import VISION_PRESETS, VisionConfig, vision_of
from ..vision.model import count_vision_parameters
from .common import add_model_arguments, config_from_args

HELP = "count total and active parameters by component (no memory used: built on the meta device)"


def add_arguments(p) -> None:
    add_model_arguments(p)
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("--vision", choices=list(VISION_PRESETS), default=None,
                   help="count this vision tower and its projector too (default: the config's vision_config, if any)")
    p.add_argument("--packed-experts", action="store_true", help="add the bytes by component with bf16 weights, "
                   "unpacked and with the routed experts packed (MXFP4, as `k3 serve --packed-experts` holds them)")


def _fmt(n: float) -> str:
    for unit, div in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= div:
            return f"{n / div:.4g}{unit}"
    return str(int(n))


def weight_bytes(cfg) -> dict:
    """{"bf16": bytes by component, "packed": the same with the routed experts packed}, on the meta device."""
    import torch

    from ..model.transformer import K3ForCausalLM
    from ..quant import pack_experts

    with torch.device("meta"):
        model = K3ForCausalLM(cfg).to(torch.bfloat16)
    bf16 = count_bytes(model)
    return {"bf16": bf16, "packed": count_bytes(pack_experts(model, quantize=False))}


def run(args) -> int:
    cfg = config_from_args(args)
    r = count_parameters(cfg)
    if args.packed_experts:
        r["bytes"] = weight_bytes(cfg)
    emb = r["by_component"]["embedding"]["total"]
    r["active_with_embedding"] = r["active"] + (0 if cfg.tie_word_embeddings else emb)
    reported = REPORTED.get(args.preset) if args.preset else None
    if reported:
        r["reported"] = reported
    vision = VisionConfig.preset(args.vision) if args.vision else vision_of(cfg.top_level)
    if vision is not None:
        r["vision"] = count_vision_parameters(vision, cfg.hidden_size)
        r["total_with_vision"] = r["total"] + sum(r["vision"].values())
    if args.json:
        print(json.dumps(r, indent=2))
        return 0
    name = args.preset or args.config
    print(f"{name}: {cfg.num_hidden_layers} layers ({len(cfg.kda_layers)} KDA, {len(cfg.full_attn_layers)} MLA), "
          f"hidden {cfg.hidden_size}, {cfg.num_experts} experts top-{cfg.num_experts_per_token}")
    b = r.get("bytes")
    mem = f"{'bf16 GiB':>12}{'packed GiB':>12}" if b else ""
    print(f"{'component':<16}{'total':>20}{'active':>20}{mem}")
    for c in COMPONENTS:
        v = r["by_component"][c]
        if v["total"]:
            mem = f"{b['bf16'][c] / 2**30:>12.4g}{b['packed'][c] / 2**30:>12.4g}" if b else ""
            print(f"{c:<16}{v['total']:>20,}{v['active']:>20,}{mem}")
    mem = f"{sum(b['bf16'].values()) / 2**30:>12.4g}{sum(b['packed'].values()) / 2**30:>12.4g}" if b else ""
    print(f"{'TOTAL':<16}{r['total']:>20,}{r['active']:>20,}{mem}")
    for c, n in r.get("vision", {}).items():  # not active (SPEC §1), and outside the text model's total
        print(f"{c:<16}{n:>20,}{'-':>20}")
    if "vision" in r:
        print(f"{'TOTAL + vision':<16}{r['total_with_vision']:>20,}{r['active']:>20,}")
    if b:
        ratio = b["packed"]["routed_experts"] / b["bf16"]["routed_experts"]
        print(f"routed experts packed (MXFP4: 4 bits + one E8M0 scale per 32 weights): {ratio:.4f}x their bf16 bytes")
    print(f"total {_fmt(r['total'])}, active {_fmt(r['active'])} (head counted, input embedding not; MTP excluded); "
          f"active incl. input embedding {_fmt(r['active_with_embedding'])}")
    if "vision" in r:
        v = r["vision"]
        print(f"vision: tower {_fmt(v['vision_tower'])} + projector {_fmt(v['mm_projector'])} (not counted as active; "
              f"total with vision {_fmt(r['total_with_vision'])})")
    if reported:
        dt = r["total"] / reported["total"] - 1
        da = r["active"] / reported["active"] - 1
        da_e = r["active_with_embedding"] / reported["active"] - 1
        print(f"report: total {_fmt(reported['total'])} ({dt:+.2%}), active {_fmt(reported['active'])} "
              f"({da:+.2%}; {da_e:+.2%} counting the input embedding)")
    return 0
