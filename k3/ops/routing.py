"""Router math (SPEC §4): sigmoid scores, top-k on score + bias, weights from the unbiased scores.

Legend: N tokens, E experts, k experts per token.
"""

from __future__ import annotations

import torch

__all__ = ["router_scores", "select_experts", "bincount"]


def router_scores(logits: torch.Tensor, score_func: str = "sigmoid") -> torch.Tensor:
    if score_func == "sigmoid":
        return torch.sigmoid(logits.float())
    if score_func == "softmax":
        return torch.softmax(logits.float(), dim=-1)
    raise ValueError(f"unknown router score function {score_func!r}; expected 'sigmoid' or 'softmax'")


def select_experts(scores: torch.Tensor, bias: torch.Tensor | None, k: int, renormalize: bool = True,
                   scaling: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """scores [N,E] -> (weights [N,k] fp32, indices [N,k]).

    The bias only decides WHICH experts are chosen (it carries no gradient and never enters the weights):
    that is what lets Quantile Balancing move load without changing what a chosen expert contributes.
    """
    biased = scores if bias is None else scores + bias.detach().float()
    idx = biased.topk(k, dim=-1, sorted=False).indices  # which experts, not their order: no sort kernel
    w = scores.gather(-1, idx)
    if renormalize:
        w = w / (w.sum(-1, keepdim=True) + 1e-20)
    return w * scaling, idx


def bincount(x: torch.Tensor, n: int) -> torch.Tensor:
    """int64 [n]: how often each value of ``x`` (any shape, integers in [0, n)) occurs. ``torch.bincount`` on CUDA
    reads x's max back to the host to size its output, a wait for the GPU in every MoE layer; this never reads.
    A value outside [0, n) is an index error (on CUDA, a device-side assert)."""
    flat = x.reshape(-1).long()
    return torch.zeros(n, dtype=torch.int64, device=flat.device).scatter_add_(0, flat, torch.ones_like(flat))
