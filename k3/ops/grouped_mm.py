"""Grouped matmul for routed experts: rows sorted by expert, one matmul per expert group.

Legend: M routed rows, E experts, I in features, O out features. w [E,O,I] (the official [out, in] per expert).
On CUDA in bf16 with aligned shapes this is one ``torch._grouped_mm`` call; elsewhere a loop over experts
(never over tokens).
"""

from __future__ import annotations

import torch

__all__ = ["grouped_mm", "fused_dtypes"]


def fused_dtypes() -> tuple[torch.dtype, ...]:
    """The dtypes whose grouped matmul is one fused call on CUDA (no host read of the per-expert counts)."""
    return (torch.bfloat16,) if hasattr(torch, "_grouped_mm") else ()


def _can_fuse(x: torch.Tensor, w: torch.Tensor) -> bool:
    return (x.is_cuda and x.dtype in fused_dtypes()
            and x.shape[-1] % 8 == 0 and w.shape[1] % 8 == 0)


def grouped_mm(x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """x [M,I] sorted by expert, counts [E] rows per expert (sum M) -> [M,O]."""
    if _can_fuse(x, w):
        offs = counts.cumsum(0).to(torch.int32)
        # fp32 master weights under bf16 autocast are cast here, as autocast does for nn.Linear
        return torch._grouped_mm(x, w.to(torch.bfloat16).transpose(-1, -2), offs=offs)
    return _expert_loop(x, w, counts)


@torch.compiler.disable  # reads the counts on the host: under torch.compile a clean break, never a recompile per load
def _expert_loop(x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    # unbind, not w[e]: w[e]'s backward writes a zero-filled [E,O,I] gradient per expert (7x the loop's time with
    # 32 experts on CPU); unbind's writes one
    ws = w.unbind(0)
    outs = [xe @ ws[e].T for e, xe in enumerate(x.split(counts.tolist())) if xe.shape[0]]
    return torch.cat(outs) if outs else x.new_zeros(0, w.shape[1])
