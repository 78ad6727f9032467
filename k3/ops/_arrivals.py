"""Arrival counters for Triton kernels whose programs hand one piece of work to the last of a group to finish.

The pattern (the "last block" reduction of CUDA's threadFenceReduction sample): every program of a group does its
share, a CTA barrier puts all its threads' memory accesses before its arrival, one acquire-release atomic
increment counts the arrival, and the program that sees ``group - 1`` does what needed everyone (it reads what
the others wrote, or writes what they read) and resets the counter to zero for the next launch. Used by the KDA
decode kernel (the q/k conv tails, shifted once every program of a head has read them) and the decode router
(the top-k once every program of a token has written its block of scores).

The counters are one int32 buffer per (device, user) that only grows: a CUDA graph captured with a buffer keeps
its address, so a replaced buffer is kept alive, never freed. Each kernel has its own buffer, so two of them never
count into the same counters even if they ran on concurrent streams.
"""

from __future__ import annotations

import torch

_BUFFERS: dict[tuple[torch.device, str], torch.Tensor] = {}
_KEPT: list[torch.Tensor] = []


def arrival_counters(device: torch.device, n: int, user: str) -> torch.Tensor:
    """At least ``n`` int32 counters on ``device`` for the kernel ``user``, zero between launches (each launch's
    last programs reset theirs)."""
    buf = _BUFFERS.get((device, user))
    if buf is None or buf.numel() < n:
        buf = torch.zeros(max(n, 4096), dtype=torch.int32, device=device)
        _KEPT.append(buf)
        _BUFFERS[(device, user)] = buf
    return buf
