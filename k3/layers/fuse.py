"""Projections computed as one matmul at inference (fewer, larger kernels).

``fuse_linears`` stacks the weights of several ``nn.Linear``s that read the same input by rows into one tensor
and makes each Linear's weight a VIEW of its rows: nothing is duplicated, the parameters keep their official
names (checkpoints, optimisers and training see no difference), and ``F.linear(x, fused)`` equals
``cat([l(x) for l in linears], -1)``. ``fuse_linears(..., by_input=True)`` does the same for Linears whose
outputs are summed, by columns: ``F.linear(cat(xs, -1), fused)`` equals ``sum(l(x) for l, x in zip(linears,
xs))`` (the views are then column slices, not contiguous).
Only inference reads the fused tensors (``k3.inference.fast``: no gradient flows through them); a layer's own forward
calls ``stacked_linear``: the same one matmul over the Linears' weights concatenated for that call, so x's gradient is
one GEMM too.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["fuse_linears", "stacked_linear"]


@torch.no_grad()
def fuse_linears(linears: list[nn.Linear], by_input: bool = False) -> tuple[torch.Tensor, list[int]]:
    """-> (fused weight, the sizes in order): [sum of out features, in] and the out sizes; with ``by_input`` (the
    Linears share their output size) [out, sum of in features] and the in sizes."""
    d = 1 if by_input else 0
    if by_input and len({lin.weight.shape[0] for lin in linears}) != 1:
        raise ValueError("Linears fused by input need one output size; got "
                         f"{[lin.weight.shape[0] for lin in linears]}")
    fused = torch.cat([lin.weight for lin in linears], dim=d)
    sizes, off = [], 0
    for lin in linears:
        n = lin.weight.shape[d]
        lin.weight = nn.Parameter(fused.narrow(d, off, n), requires_grad=lin.weight.requires_grad)
        sizes.append(n)
        off += n
    return fused, sizes


def stacked_linear(x: torch.Tensor, linears: list[nn.Linear],
                   sizes: list[int] | None = None) -> tuple[torch.Tensor, ...]:
    """``tuple(l(x) for l in linears)`` (bias-free Linears of one input) as one matmul over their weights stacked by
    rows: views of one output, split by ``sizes`` (default: each Linear's; adjacent outputs may be kept together).
    Keep the summed width a multiple of 8 for cuBLAS (an unaligned width runs its slow align-2 kernels)."""
    y = F.linear(x, torch.cat([lin.weight for lin in linears]))
    return y.split(sizes if sizes is not None else [lin.out_features for lin in linears], -1)
