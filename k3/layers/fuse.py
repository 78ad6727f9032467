"""Projections computed as one matmul at inference (fewer, larger kernels).

``fuse_linears`` stacks the weights of several ``nn.Linear``s that read the same input by rows into one tensor
and makes each Linear's weight a VIEW of its rows: nothing is duplicated, the parameters keep their official
names (checkpoints, optimisers and training see no difference), and ``F.linear(x, fused)`` equals
``cat([l(x) for l in linears], -1)``. ``fuse_linears_by_input`` does the same for Linears whose outputs are
summed, by columns: ``F.linear(cat(xs, -1), fused)`` equals ``sum(l(x) for l, x in zip(linears, xs))`` (the
views are then column slices, not contiguous).
Layers use the fused tensor only when no gradient is needed (``use_fused``); with gradients they call their
Linears as before, which update the same storage.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["fuse_linears", "fuse_linears_by_input", "use_fused"]


@torch.no_grad()
def fuse_linears(linears: list[nn.Linear]) -> tuple[torch.Tensor, list[int]]:
    """-> (fused weight [sum of out features, in], the out-feature sizes in order)."""
    fused = torch.cat([lin.weight for lin in linears], dim=0)
    sizes, off = [], 0
    for lin in linears:
        n = lin.weight.shape[0]
        lin.weight = nn.Parameter(fused[off: off + n], requires_grad=lin.weight.requires_grad)
        sizes.append(n)
        off += n
    return fused, sizes


@torch.no_grad()
def fuse_linears_by_input(linears: list[nn.Linear]) -> tuple[torch.Tensor, list[int]]:
    """-> (fused weight [out, sum of in features], the in-feature sizes in order); the Linears share ``out``."""
    outs = {lin.weight.shape[0] for lin in linears}
    if len(outs) != 1:
        raise ValueError(f"Linears fused by input need one output size; got {sorted(outs)}")
    fused = torch.cat([lin.weight for lin in linears], dim=1)
    sizes, off = [], 0
    for lin in linears:
        n = lin.weight.shape[1]
        lin.weight = nn.Parameter(fused[:, off: off + n], requires_grad=lin.weight.requires_grad)
        sizes.append(n)
        off += n
    return fused, sizes


def use_fused(fused: torch.Tensor | None) -> bool:
    return fused is not None and not torch.is_grad_enabled()
