"""Causal depthwise short convolution with a decode state (KDA's q/k/v ShortConv, SPEC §2.1).

Legend: B batch, T time, D channels, W kernel width, N sequences. weight [D, 1, W] (nn.Conv1d layout);
state [N, D, W-1] holds the last W-1 inputs of each sequence, oldest first.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .varlen import pack_sequences, unpack_sequences

__all__ = ["short_conv"]


def short_conv(
    x: torch.Tensor,
    weight: torch.Tensor,
    state: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    output_final_state: bool = False,
    activation: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """y_t = act(sum_i w_i x_{t-W+1+i}); never looks across a document boundary of ``cu_seqlens``.

    x [B,T,D] (B = 1 when packed). Returns (y [B,T,D], final state [N,D,W-1] or None).
    """
    D, W = weight.shape[0], weight.shape[-1]
    if x.shape[-1] != D:
        raise ValueError(f"short_conv: x has {x.shape[-1]} channels, weight has {D}")
    rows = None
    if cu_seqlens is not None:
        x, rows = pack_sequences(x, cu_seqlens)
    N, T, _ = x.shape
    if state is None:
        state = x.new_zeros(N, D, W - 1)
    elif state.shape != (N, D, W - 1):
        raise ValueError(f"short_conv state must be [N,D,W-1] = [{N},{D},{W - 1}]; got {tuple(state.shape)}")
    xt = torch.cat([state.to(x.dtype), x.transpose(1, 2)], dim=-1)  # [N, D, W-1+T]
    y = F.conv1d(xt, weight.to(x.dtype).view(D, 1, W), groups=D).transpose(1, 2)  # [N, T, D]
    if activation:
        y = F.silu(y)
    final = None
    if output_final_state:
        if rows is None:
            final = xt[..., -(W - 1):] if W > 1 else xt[..., :0]
        else:
            lens = rows.valid.sum(1)  # the last W-1 real inputs sit at [len, len+W-1) of xt
            idx = lens[:, None] + torch.arange(W - 1, device=x.device)[None]
            final = xt.gather(2, idx[:, None, :].expand(N, D, W - 1))
    if rows is not None:
        y = unpack_sequences(y, rows)
    return y, final
