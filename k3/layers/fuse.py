"""Projections that read the same input, computed as one matmul at inference (fewer, larger kernels).

``fuse_linears`` stacks the weights of several ``nn.Linear``s by rows into one tensor and makes each Linear's
weight a VIEW of its rows: nothing is duplicated, the parameters keep their official names (checkpoints,
optimisers and training see no difference), and ``F.linear(x, fused)`` equals ``cat([l(x) for l in linears], -1)``.
Layers use the fused tensor only when no gradient is needed (``use_fused``); with gradients they call their
Linears as before, which update the same storage.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["fuse_linears", "use_fused"]


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


def use_fused(fused: torch.Tensor | None) -> bool:
    return fused is not None and not torch.is_grad_enabled()
