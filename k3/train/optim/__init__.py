"""The K3 optimiser (SPEC §5): Muon for hidden matrices, AdamW for everything else, as ONE Optimizer.

    describe_param_groups(model)  name -> ParamPlan(optimizer, split, weight_decay), the single source of truth
    build_optimizer(model, lr)    a CombinedOptimizer(muon=Muon(...), adamw=AdamW(...)) built from that plan
    clip_coefficient(params, c)   the gradients' norm and clipping's factor, applied by step(scale=...) in its passes

Muon gets every 2-D hidden matrix; attention projections whose rows (or, for output projections, columns) are
grouped by head are orthogonalised per head ("rows:H" / "cols:H"), routed experts [E, out, in] per expert
("experts"). AdamW gets embeddings, the LM head, norms, biases, A_log/dt_bias, conv taps, the AttnRes
pseudo-queries [1, D] and any other vector; of a vision tower (k3.vision), its patch embedding (a Conv2d) and its
learned position grid (``pos_emb``, an embedding table). Both share one lr: Muon's step is scaled to AdamW's RMS.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.experimental import implicit_replication

from ...layers.sequence.kda import KimiDeltaAttention, ShortConvolution
from ...layers.sequence.mla import GatedMLA
from .muon import Muon, newton_schulz

__all__ = ["Muon", "newton_schulz", "ParamPlan", "describe_param_groups", "build_optimizer", "CombinedOptimizer",
           "clip_coefficient"]


class ParamPlan(NamedTuple):
    optimizer: str  # "muon" | "adamw"
    split: str | None  # Muon: "whole" | "rows:H" | "cols:H" | "experts"; AdamW: None
    weight_decay: bool


# Per-head splits of the attention projections, by the owning module's class (rows grouped by head unless "cols").
_KDA_HEADS = {"q_proj": "rows", "k_proj": "rows", "v_proj": "rows", "g_proj": "rows", "f_b_proj": "rows",
              "g_b_proj": "rows", "o_proj": "cols"}
_MLA_HEADS = {"q_proj": "rows", "q_b_proj": "rows", "kv_b_proj": "rows", "g_proj": "rows", "o_proj": "cols"}
_ADAMW_NAMES = ("embed_tokens", "lm_head", "pos_emb")


def _head_splits(model: nn.Module) -> dict[str, str]:
    """Parameter name -> per-head or per-expert split, found by module type (not by name patterns)."""
    out = {}
    for mname, mod in model.named_modules():
        pre = f"{mname}." if mname else ""
        table = _KDA_HEADS if isinstance(mod, KimiDeltaAttention) else _MLA_HEADS if isinstance(mod, GatedMLA) else {}
        for child, kind in table.items():
            if isinstance(getattr(mod, child, None), nn.Linear):
                out[f"{pre}{child}.weight"] = f"{kind}:{mod.num_heads}"
        if getattr(mod, "routed_experts", False):  # ExpertBank, or its expert-parallel shard
            for pname, _ in mod.named_parameters(recurse=False):
                out[f"{pre}{pname}"] = "experts"
    return out


def describe_param_groups(model: nn.Module, per_head: bool = True) -> dict[str, ParamPlan]:
    """For each parameter name, which optimiser and split it gets (tied weights appear once)."""
    heads = _head_splits(model)
    convs = {f"{m}.{p}" if m else p for m, mod in model.named_modules()
             if isinstance(mod, (ShortConvolution, nn.Conv1d, nn.Conv2d)) for p, _ in mod.named_parameters(recurse=False)}
    plan = {}
    for name, p in model.named_parameters():
        split = heads.get(name)
        if split == "experts":
            plan[name] = ParamPlan("muon", "experts", True)
        elif name in convs or any(n in name for n in _ADAMW_NAMES) or _is_embedding(model, name):
            plan[name] = ParamPlan("adamw", None, True)
        elif p.dim() == 3:
            raise ValueError(f"{name}: 3-D parameter {tuple(p.shape)} is neither a routed-expert bank (ExpertBank) "
                             "nor a conv weight; say how to optimise it before building the optimiser")
        elif p.dim() < 2 or 1 in p.shape:  # norms, biases, A_log/dt_bias, AttnRes pseudo-queries [1, D]
            plan[name] = ParamPlan("adamw", None, False)
        elif p.dim() == 2:
            plan[name] = ParamPlan("muon", split if (split and per_head) else "whole", True)
        else:
            raise ValueError(f"{name}: {p.dim()}-D parameter {tuple(p.shape)} has no optimiser rule")
    return plan


def _is_embedding(model: nn.Module, name: str) -> bool:
    mname, _, _ = name.rpartition(".")
    return isinstance(model.get_submodule(mname) if mname else model, nn.Embedding)


class CombinedOptimizer(torch.optim.Optimizer):
    """Several optimisers over disjoint parameters, stepped together.

    ``param_groups`` is the concatenation of the children's group dicts (the same objects), so an LR scheduler
    that scales ``group["lr"]`` reaches them; ``state_dict`` holds one entry per child, by name.
    """

    def __init__(self, **optimizers: torch.optim.Optimizer):
        if not optimizers:
            raise ValueError("CombinedOptimizer needs at least one optimiser, e.g. muon=..., adamw=...")
        self.optimizers = optimizers
        # The base class checks that no parameter appears in two children; then we share the children's groups.
        super().__init__([{"params": g["params"]} for o in optimizers.values() for g in o.param_groups], {})
        self._link()
        self._built = True

    def add_param_group(self, param_group: dict) -> None:
        if getattr(self, "_built", False):
            raise TypeError("CombinedOptimizer cannot take new groups: give every group to its part (Muon or "
                            "AdamW) first, then wrap the parts in a new CombinedOptimizer(**parts)")
        super().add_param_group(param_group)

    def _link(self):
        self.param_groups = [g for o in self.optimizers.values() for g in o.param_groups]
        self.state = {p: s for o in self.optimizers.values() for p, s in o.state.items()}

    @torch.no_grad()
    def step(self, closure=None, scale: torch.Tensor | None = None):
        """Step every part. ``scale``: a 0-d tensor on the gradients' device that every gradient is multiplied by
        first (gradient clipping's coefficient, ``clip_coefficient``), folded into the parts' own passes where they
        have one: Muon's momentum kernel, fused AdamW's ``grad_scale`` (which divides: 1 / scale); any other part's
        gradients are multiplied in place."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for o in self.optimizers.values():
            if scale is None:
                o.step()
            elif isinstance(o, Muon):
                o.step(scale=scale)
            elif isinstance(o, torch.optim.AdamW) and all(g.get("fused") for g in o.param_groups):
                o.grad_scale = scale.reciprocal()
                try:
                    o.step()
                finally:
                    del o.grad_scale
            else:
                grads = [p.grad for g in o.param_groups for p in g["params"] if p.grad is not None]
                with implicit_replication():  # DTensor gradients (FSDP2): the plain 0-d scale as a replicated factor
                    torch._foreach_mul_(grads, scale)
                o.step()
        self._link()  # children create state lazily on their first step
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        for o in self.optimizers.values():
            o.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict:
        return {name: o.state_dict() for name, o in self.optimizers.items()}

    def load_state_dict(self, state_dict: dict) -> None:
        if set(state_dict) != set(self.optimizers):
            raise ValueError(f"optimizer state has parts {sorted(state_dict)}, this optimizer has "
                             f"{sorted(self.optimizers)}; was it saved by a differently built optimizer?")
        for name, o in self.optimizers.items():
            o.load_state_dict(state_dict[name])
        self._link()  # load_state_dict replaces the children's group dicts and state

    def __repr__(self) -> str:
        return f"CombinedOptimizer({', '.join(f'{k}={type(o).__name__}' for k, o in self.optimizers.items())})"


def clip_coefficient(params, max_norm: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(the global L2 norm of the gradients of ``params``, gradient clipping's coefficient), both 0-d tensors on the
    device, the gradients untouched:

        norm = sqrt(sum_p ||g_p||^2),   coef = min(1, max_norm / (norm + 1e-6))        (torch's clip_grad_norm_)

    The step then multiplies by ``coef`` inside its own passes (``CombinedOptimizer.step(scale=coef)``) instead of a
    pass of its own over every gradient. FSDP2 shards (DTensors) give the norm over the whole gradients."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        raise ValueError("clip_coefficient: no parameter has a gradient (run the backward first)")
    norm = torch.nn.utils.get_total_norm(grads, 2.0)
    norm = norm.full_tensor() if isinstance(norm, DTensor) else norm
    return norm, (max_norm / (norm + 1e-6)).clamp(max=1.0)


def build_optimizer(model: nn.Module, lr: float = 2e-4, weight_decay: float = 0.1,
                    adam_betas: tuple[float, float] = (0.9, 0.95), adam_eps: float = 1e-8, per_head: bool = True,
                    momentum: float = 0.95) -> CombinedOptimizer:
    """Muon + AdamW over ``model`` following ``describe_param_groups``; one Muon group per split, two AdamW
    groups (with and without weight decay). Every group has a "name" for logging. A part with no parameters
    (e.g. AdamW for a bare expert bank) is left out. AdamW is torch's fused kernel when its parameters are plain
    CUDA tensors (a few launches for all of them instead of a foreach chain per group; the same update), its
    foreach form otherwise (CPU, DTensor shards)."""
    params = dict(model.named_parameters())
    muon_groups: dict[str, list] = {}
    adam_groups: dict[bool, list] = {True: [], False: []}
    for name, plan in describe_param_groups(model, per_head).items():
        if plan.optimizer == "muon":
            muon_groups.setdefault(plan.split, []).append(params[name])
        else:
            adam_groups[plan.weight_decay].append(params[name])
    parts = {}
    if muon_groups:
        parts["muon"] = Muon([{"params": ps, "split": s, "name": f"muon/{s}"} for s, ps in muon_groups.items()],
                             lr=lr, momentum=momentum, weight_decay=weight_decay)
    if adam_groups[True] or adam_groups[False]:
        adam = adam_groups[True] + adam_groups[False]
        fused = all(p.is_cuda and type(p) is nn.Parameter for p in adam) or None
        parts["adamw"] = torch.optim.AdamW(
            [{"params": ps, "weight_decay": weight_decay if decay else 0.0,
              "name": "adamw/" + ("decay" if decay else "no_decay")} for decay, ps in adam_groups.items() if ps],
            lr=lr, betas=adam_betas, eps=adam_eps, fused=fused)
    return CombinedOptimizer(**parts)
