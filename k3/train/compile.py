"""Regional ``torch.compile`` for training (``k3 train --compile``), applied from outside the model code.

What is compiled, per decoder layer (the MTP layer's too): the FFN (a LatentMoE: router, latent projections,
dispatch, expert matmuls, combine, norm and shared experts; or the dense GatedMLP), KDA's gated per-head output
norm, MLA's two latent RMSNorms; the model's final norm and the MTP layers' input and head norms (each eager
RMSNorm is ~8 fp32 kernels forward and ~10 backward over its rows, one fused kernel each way compiled); every
"attn_res" region (``k3.ops.regions``: the AttnRes mix and the sub-layer's pre-norm; on CUDA it is
one Triton kernel forward and backward, which runs as it is), every
"kda_activations" region (the L2 norms, forget gate and beta between KDA's short convs and its recurrence), every
"mla_output" region (MLA's sigmoid output gate in fp32 and the cast for its output projection) and the
"lm_loss" region (a chunk's LM head and cross-entropy: the fp32 cast, log-softmax and gather fused over the bf16
logits). These are the parts made of many small elementwise and reduction kernels. The token mixers' kernels (fla's KDA, MLA's
attention over packed documents, which plans its groups on the host) stay eager: torchtitan compiles whole blocks,
but a whole K3 layer carries a host-planned attention and the KDA reference's data-dependent loops.

Compiled regions compute the same function; inductor may reorder floating-point sums, so losses and gradients
agree to float rounding (tests/train/test_compile.py). The CPU needs a C compiler for inductor.
"""

from __future__ import annotations

import torch
from torch import nn

from ..ops.regions import REGIONS, set_region_compiler

__all__ = ["compile_model", "compiled_regions"]

# the regions compiled as graphs of their own: every one but "moe_experts", which runs inside a compiled FFN
_OWN_GRAPHS = tuple(r for r in REGIONS if r != "moe_experts")


def compiled_regions(model: nn.Module) -> list[nn.Module]:
    """The modules ``compile_model`` compiles in place."""
    from ..layers.norm import RMSNorm
    from ..model.block import DecoderLayer

    out = []
    for layer in model.modules():
        if isinstance(layer, DecoderLayer):
            out.append(layer.block_sparse_moe if hasattr(layer, "block_sparse_moe") else layer.mlp)
            if layer.kind == "kda":
                out.append(layer.self_attn.o_norm)
    inside = {id(sub) for m in out for sub in m.modules()}
    # every RMSNorm outside those (one AttnRes fuses into its mix, or only lends its weight, is never called)
    return out + [m for m in model.modules() if isinstance(m, RMSNorm) and id(m) not in inside]


def compile_model(model: nn.Module, **options) -> None:
    """Compile ``model``'s regions in place (``nn.Module.compile``: parameter names unchanged) and the "attn_res",
    "kda_activations", "mla_output" and "lm_loss" regions of every model in this process; ``options`` go to
    ``torch.compile``."""
    for m in compiled_regions(model):
        m.compile(**options)
    compiled = {}

    def compiler(name, fn):
        if name not in _OWN_GRAPHS:
            return fn
        if fn not in compiled:
            compiled[fn] = _unless_kernel(fn, torch.compile(fn, **options)) if name == "attn_res" else \
                torch.compile(fn, **options)
        return compiled[fn]

    # one graph per number of depth sources (up to the number of AttnRes blocks + 1), train and eval
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 32)
    set_region_compiler(compiler)


def _unless_kernel(fn, compiled_fn):
    """An "attn_res" region (``fn(eps, proj_weight, key_norm_weight, norm, sinks, *sources)``) runs eagerly where it
    is one Triton kernel (``k3.ops.attn_res.uses_kernel``: CUDA, enough rows): compiling it then adds only dynamo's
    guards and a graph break around the kernel, on every call. (``sinks`` is None on the compiled path.)"""
    from ..ops import attn_res

    def run(*args):
        return fn(*args) if attn_res.uses_kernel(list(args[5:])) else compiled_fn(*args)

    return run
