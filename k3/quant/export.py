"""The release's compressed-tensors layout of the routed experts (SPEC §6): format ``mxfp4-pack-quantized``,
group size 32, weights only.

Per routed expert the checkpoint holds ``...experts.{e}.w{1,2,3}.weight_packed`` uint8 [out, in/2] (element 2i in
the low nibble) and ``weight_scale`` uint8 [out, in/32] (E8M0), and the text config's ``quantization_config``
describes them; attention, latent projections, shared experts, router, dense FFN and head stay high precision (the
release's ``ignore`` list). In our state dict a bank's three tensors are 3-D: ``...experts.w1`` [E, out, in] becomes
``...experts.w1.weight_packed`` [E, out, in/2] and ``...experts.w1.weight_scale`` [E, out, in/32];
k3.checkpoint splits them per expert.
"""

from __future__ import annotations

import copy
import re

import torch

from ..ops.mx import quantize_mxfp4

__all__ = ["QUANTIZATION_CONFIG", "quantization_config", "pack_expert_state", "is_packed_state"]

FORMAT = "mxfp4-pack-quantized"
# The fields and values of the release's config (compressed-tensors' QuantizationConfig / QuantizationArgs); the
# target is the routed experts' three matrices by name, which is exactly what the release's ignore list leaves.
QUANTIZATION_CONFIG = {
    "config_groups": {
        "group_0": {
            "format": FORMAT,
            "input_activations": None,
            "output_activations": None,
            "targets": [r"re:.*\.experts\.\d+\.w[123]$"],
            "weights": {"actorder": None, "block_structure": None, "dynamic": False, "group_size": 32,
                        "num_bits": 4, "observer": "minmax", "observer_kwargs": {}, "scale_dtype": "torch.uint8",
                        "strategy": "group", "symmetric": True, "type": "float", "zp_dtype": None},
        },
    },
    "format": FORMAT,
    "global_compression_ratio": None,
    "ignore": ["re:.*self_attn.*", "re:.*shared_experts.*", r"re:.*mlp\.(gate|up|gate_up|down)_proj.*",
               "re:.*lm_head.*", "re:.*vision_tower.*", "re:.*mm_projector.*"],
    "kv_cache_scheme": None,
    "quant_method": "compressed-tensors",
    "quantization_status": "compressed",
}

_BANK = re.compile(r"\.experts\.w[123]$")


def quantization_config() -> dict:
    """A fresh copy of the ``quantization_config`` written beside packed experts."""
    return copy.deepcopy(QUANTIZATION_CONFIG)


def pack_expert_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Our state dict with every routed bank ``...experts.w{n}`` [E,out,in] (float) replaced by its MXFP4
    ``.weight_packed`` / ``.weight_scale``; banks already packed and every other tensor pass through."""
    out = {}
    for name, t in state.items():
        if _BANK.search(name) and t.is_floating_point():
            out[f"{name}.weight_packed"], out[f"{name}.weight_scale"] = quantize_mxfp4(t)
        else:
            out[name] = t
    return out


def is_packed_state(state: dict[str, torch.Tensor]) -> bool:
    return any(name.endswith(".weight_packed") for name in state)
