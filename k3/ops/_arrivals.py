"""Arrival counters for Triton kernels whose programs hand one piece of work to the last of a group to finish.

The pattern (the "last block" reduction of CUDA's threadFenceReduction sample): every program of a group does its
share, a CTA barrier puts all its threads' memory accesses before its arrival, one acquire-release atomic
increment counts the arrival, and the program that sees ``group - 1`` does what needed everyone (it reads what
the others wrote, or writes what they read) and resets the counter to zero for the next launch. Used by the KDA
decode kernel (the q/k conv tails, shifted once every program of a head has read them) and the decode router
(the top-k once every program of a token has written its block of scores).

The counters are one int32 buffer per device that only grows: a CUDA graph captured with a buffer keeps its
address, so a replaced buffer is kept alive, never freed.
"""

from __future__ import annotations

import torch

_BUFFERS: dict[torch.device, torch.Tensor] = {}
_KEPT: list[torch.Tensor] = []


def arrival_counters(device: torch.device, n: int) -> torch.Tensor:
    """At least ``n`` int32 counters on ``device``, zero between launches (each kernel's last program resets its
    own)."""
    buf = _BUFFERS.get(device)
    if buf is None or buf.numel() < n:
        buf = torch.zeros(max(n, 4096), dtype=torch.int32, device=device)
        _KEPT.append(buf)
        _BUFFERS[device] = buf
    return buf
