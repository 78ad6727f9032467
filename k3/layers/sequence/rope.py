"""Rotary position encoding of MLA's rope dims, plain or YaRN-extended (Kimi K2 / DeepSeek-V3; K3's MLA is NoPE).

Legend: Dr rope dims (pairs rotate together: interleaved (x0, x1), (x2, x3), ...), P positions.

Plain RoPE: pair i turns by angle p * w_i, w_i = theta^(-2i/Dr).

YaRN (Peng et al. 2023, as DeepSeek-V3 and transformers compute it): with scale s = ``factor`` and the pretraining
length L = ``original_max_position_embeddings``, pairs that turn fast (more than ``beta_fast`` rotations over L)
keep w_i (extrapolation), slow ones (fewer than ``beta_slow``) are interpolated to w_i / s, with a linear ramp
between. The ramp's ends are the dims d(r) = Dr ln(L / (2 pi r)) / (2 ln theta) at r = beta_fast and beta_slow
(floored / ceiled unless ``truncate`` is false):
    w'_i = w_i / s * ramp_i + w_i * (1 - ramp_i),   ramp_i = clamp((i - d_lo) / (d_hi - d_lo), 0, 1)
cos and sin are multiplied by the attention factor a = m(s, mscale) / m(s, mscale_all_dim) (both given), else
m(s, 1), with m(s, k) = 0.1 k ln s + 1 (1 for s <= 1); and the softmax scale by m(s, mscale_all_dim)^2 when
``mscale_all_dim`` is set (``softmax_scale``).
"""

from __future__ import annotations

import math

import torch

__all__ = ["rope_frequencies", "rotary", "softmax_scale"]

def _mscale(scale: float, k: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * k * math.log(scale) + 1.0


def rope_frequencies(dim: int, theta: float, scaling: dict | None, device=None) -> tuple[torch.Tensor, float]:
    """(w [dim/2] fp32, attention factor a): the angular speed of each rotating pair and the factor on cos/sin."""
    inv = 1.0 / theta ** (torch.arange(0, dim, 2, device=device, dtype=torch.float32) / dim)
    if scaling is None:
        return inv, 1.0
    s, L = float(scaling["factor"]), float(scaling["original_max_position_embeddings"])
    fast, slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return dim * math.log(L / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    lo, hi = correction_dim(fast), correction_dim(slow)
    if scaling.get("truncate", True):
        lo, hi = math.floor(lo), math.ceil(hi)
    lo, hi = max(lo, 0), min(hi, dim - 1)
    if lo == hi:
        hi += 0.001  # a one-point ramp
    ramp = ((torch.arange(dim // 2, device=device, dtype=torch.float32) - lo) / (hi - lo)).clamp(0, 1)
    inv = inv / s * ramp + inv * (1 - ramp)
    a = scaling.get("attention_factor")
    if a is None:
        m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
        a = _mscale(s, m) / _mscale(s, m_all) if m and m_all else _mscale(s)
    return inv, float(a)


def softmax_scale(qk_head_dim: int, scaling: dict | None) -> float:
    """1/sqrt(qk_head_dim), times m(s, mscale_all_dim)^2 under YaRN with ``mscale_all_dim`` set."""
    scale = qk_head_dim ** -0.5
    if scaling is not None and scaling.get("mscale_all_dim"):
        scale *= _mscale(float(scaling["factor"]), scaling["mscale_all_dim"]) ** 2
    return scale


def rotary(x: torch.Tensor, positions: torch.Tensor, freqs: tuple[torch.Tensor, float]) -> torch.Tensor:
    """Interleaved-pair RoPE on the last dim. x [B,T,*,Dr], positions [B,T], freqs = ``rope_frequencies(Dr, ...)``
    -> x rotated (x's dtype)."""
    inv, a = freqs
    ang = positions.float()[..., None] * inv  # [B,T,Dr/2]
    while ang.dim() < x.dim():
        ang = ang.unsqueeze(-2)
    cos, sin = ang.cos() * a, ang.sin() * a
    x1, x2 = x.float()[..., 0::2], x.float()[..., 1::2]
    return torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).flatten(-2).to(x.dtype)
