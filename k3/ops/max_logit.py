"""The per-head maximum attention logit over causal, within-document pairs: QK-clip's statistic (SPEC §5).

Legend: B rows, H heads, T positions, D the q/k head dim (MLA: nope + rope), C query chunk. For head h

    m_h = max over rows b and pairs (i, j) with start(i) <= j <= i of  (q[b,h,i] . k[b,h,j]) * scale,

where start(i) is the first position of i's document (0 for unpacked rows). Only the maximum is needed, not the
softmax: a pass over the causal pairs like attention's QK^T, without its exponentials or its values.

- ``causal_max_logit_reference``: query chunks of C rows against the keys up to the chunk's end, in fp32 (CPU, and
  the test oracle). Its scores are [B,H,C,T] fp32 tensors, masked and reduced: on a GPU that is most of an MLA
  layer's forward (the masked fill and the max read and write every score).
- ``causal_max_logit_triton``: one program per (query block, head, row) streams the key blocks from the earliest
  document start among its queries to its last query, the q.k products on tensor cores with fp32 accumulation,
  masked in registers; a running max per query, one value per program written out.
"""

from __future__ import annotations

import torch

from ._triton import triton_available

__all__ = ["causal_max_logit", "causal_max_logit_reference", "causal_max_logit_triton"]


@torch.no_grad()
def causal_max_logit_reference(q: torch.Tensor, k: torch.Tensor, scale: float, starts: torch.Tensor | None = None,
                               valid: torch.Tensor | None = None, chunk: int = 1024) -> torch.Tensor:
    """q, k [B,H,T,D]; ``starts`` [T] int: each position's document start (None: 0, every row one document);
    ``valid`` [B,T] bool: real (non-padding) positions, or None. -> [H] fp32 (-inf for a head with no pair)."""
    B, H, T, _ = q.shape
    q, k = q.float(), k.float()
    pos = torch.arange(T, device=q.device)
    best = torch.full((H,), float("-inf"), dtype=torch.float32, device=q.device)
    for i in range(0, T, chunk):
        j = min(T, i + chunk)  # keys after the chunk's last query are never visible
        s = (q[:, :, i:j] @ k[:, :, :j].transpose(-1, -2)) * scale  # [B,H,C,j]
        vis = pos[None, :j] <= pos[i:j, None]  # [C,j]
        if starts is not None:
            vis = vis & (pos[None, :j] >= starts[i:j, None].to(pos.device))
        vis = vis[None, None]
        if valid is not None:
            vis = vis & valid[:, None, i:j, None] & valid[:, None, None, :j]
        best = torch.maximum(best, s.masked_fill(~vis, float("-inf")).amax(dim=(0, 2, 3)))
    return best


@torch.no_grad()
def causal_max_logit_triton(q: torch.Tensor, k: torch.Tensor, scale: float,
                            starts: torch.Tensor | None = None) -> torch.Tensor:
    """``causal_max_logit_reference`` (without padding) as one Triton kernel; q, k may be any strided views."""
    from ._max_logit_triton import launch

    return launch(q, k, scale, starts)


def causal_max_logit(q: torch.Tensor, k: torch.Tensor, scale: float, starts: torch.Tensor | None = None,
                     valid: torch.Tensor | None = None) -> torch.Tensor:
    """The Triton kernel on CUDA (when importable and there is no padding mask), the reference elsewhere."""
    if q.is_cuda and valid is None and triton_available():
        return causal_max_logit_triton(q, k, scale, starts)
    return causal_max_logit_reference(q, k, scale, starts, valid)
