"""MXFP4 (OCP microscaling) for the released routed-expert weights (SPEC §6): E2M1 elements, two per byte
(element 2i in the low nibble), one E8M0 scale (2^(s-127)) per 32 elements along the input dim.
Layout as in compressed-tensors ``mxfp4-pack-quantized``: weight_packed [out, in/2] uint8, weight_scale
[out, in/32] uint8.
"""

from __future__ import annotations

import torch

__all__ = ["dequantize_mxfp4", "quantize_mxfp4", "E2M1_VALUES"]

E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
GROUP = 32


def _table(device) -> torch.Tensor:
    pos = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=device)
    return torch.cat([pos, -pos])  # bit 3 is the sign


def dequantize_mxfp4(packed: torch.Tensor, scale: torch.Tensor, dtype=torch.bfloat16) -> torch.Tensor:
    if packed.dtype != torch.uint8 or scale.dtype != torch.uint8:
        raise ValueError(f"MXFP4 tensors must be uint8; got packed {packed.dtype}, scale {scale.dtype}")
    out_f, half = packed.shape
    n_in = 2 * half
    if scale.shape != (out_f, n_in // GROUP):
        raise ValueError(f"MXFP4 scale must be [{out_f}, {n_in // GROUP}] for packed {tuple(packed.shape)}; "
                         f"got {tuple(scale.shape)}")
    t = _table(packed.device)
    p = packed.long()
    vals = torch.stack([t[p & 0xF], t[p >> 4]], dim=-1).view(out_f, n_in)
    s = torch.exp2(scale.float() - 127.0).repeat_interleave(GROUP, dim=1)
    return (vals * s).to(dtype)


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Round-to-nearest MXFP4 with the OCP scale choice: 2^(floor(log2(amax)) - 2), so amax maps into [4, 8)."""
    out_f, n_in = w.shape
    if n_in % GROUP:
        raise ValueError(f"MXFP4 needs the input dim to be a multiple of {GROUP}; got {n_in}")
    g = w.float().view(out_f, n_in // GROUP, GROUP)
    amax = g.abs().amax(-1, keepdim=True).clamp_min(2.0**-126)
    e = (torch.floor(torch.log2(amax)) - 2).clamp(-127, 127)
    x = g / torch.exp2(e)
    pos = torch.tensor(E2M1_VALUES, device=w.device)
    code = (x.abs()[..., None] - pos).abs().argmin(-1) | ((x < 0).long() << 3)
    code = code.view(out_f, n_in)
    packed = (code[:, 0::2] | (code[:, 1::2] << 4)).to(torch.uint8)
    return packed, (e + 127).to(torch.uint8).view(out_f, -1)
