"""Optimiser state by parameter name: what lets a checkpoint of one layout (pipeline stages, one process) resume
under another. ``CombinedOptimizer.state_dict`` numbers parameters by their place in its groups, which depends on
which layers a process holds; names (``model.layers.3.self_attn.q_proj.weight``) do not.

    {"format": "by_name", "state": {name: {"momentum_buffer": tensor, ...} or {"step": ..., "exp_avg": ...}},
     "groups": {group name ("muon/whole", "adamw/decay", ...): its settings (lr, betas, ...)}}

The groups' settings matter: the schedule writes each step's lr into them, and the step after a resume runs with
the saved lr (a scheduler's load_state_dict does not write it back).
"""

from __future__ import annotations

import torch

__all__ = ["named_state", "load_named_state", "is_named", "to_named"]


def is_named(state: dict) -> bool:
    return isinstance(state, dict) and state.get("format") == "by_name"


def named_state(model, optimizer) -> dict:
    """The per-parameter state of ``optimizer`` (a CombinedOptimizer over ``model``), keyed by name, on the CPU."""
    names = {id(p): n for n, p in model.named_parameters()}
    out = {}
    for part in optimizer.optimizers.values():
        for p, s in part.state.items():
            out[names[id(p)]] = {k: v.detach().cpu().clone() if isinstance(v, torch.Tensor) else v for k, v in s.items()}
    groups = {g["name"]: {k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups if "name" in g}
    return {"format": "by_name", "state": out, "groups": groups}


def load_named_state(model, optimizer, state: dict) -> None:
    """Load a ``named_state`` into ``optimizer``: each parameter of ``model`` takes its name's entry (tensors shaped
    as the parameter go to its device; others, e.g. AdamW's step count, stay as saved). A parameter without one
    starts fresh; an entry this model does not hold (another stage's) is skipped."""
    if not is_named(state):
        raise ValueError("load_named_state takes {'format': 'by_name', 'state': ...} (named_state's output)")
    names = {id(p): n for n, p in model.named_parameters()}
    for part in optimizer.optimizers.values():
        for group in part.param_groups:
            for p in group["params"]:
                saved = state["state"].get(names[id(p)])
                if saved is None:
                    continue
                part.state[p] = {k: v.to(p.device) if isinstance(v, torch.Tensor) and v.shape == p.shape else v
                                 for k, v in saved.items()}
    for group in optimizer.param_groups:
        group.update(state.get("groups", {}).get(group.get("name"), {}))
    optimizer._link()


def to_named(model, state: dict, build) -> dict:
    """A one-process ``CombinedOptimizer.state_dict`` of ``model`` (numbered) -> by name, through a fresh optimiser
    ``build(model)`` (its state is created only by loading, so this costs the state's size)."""
    if is_named(state):
        return state
    opt = build(model)
    opt.load_state_dict(state)
    return named_state(model, opt)
