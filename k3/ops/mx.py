"""OCP Microscaling formats (MX v1.0) for SPEC §6: MXFP4 (E2M1 elements) for the routed-expert weights, MXFP8
(E4M3 elements) for their input activations.

A block of 32 consecutive values along the last (input) dimension shares one E8M0 scale X = 2^(s - 127):

    s - 127 = clamp(floor(log2 max_i |v_i|) - emax, -127, 127)    emax = 2 for E2M1 (max 6), 8 for E4M3 (max 448)
    p_i     = v_i / X rounded to nearest, ties to even, on the element grid, saturated at +-max
    v_i    ~= X * p_i                                              (the block max lands in [2^emax, 2^(emax+1)))

Special values, as in the spec's reference implementation (microsoft/microxcaling): a block whose max magnitude is
NaN or Inf gets the NaN scale s = 255 and decodes to NaN throughout (neither E8M0 nor the elements have an Inf); an
all-zero block gets s = 0 (X = 2^-127); an element below half the smallest subnormal rounds to (signed) zero.
Codes: E2M1 is s.ee.m (bias 1, 0.5 the only subnormal), E4M3 s.eeee.mmm (bias 7, the "fn" variant: no Inf, NaN is
s.1111.111). MXFP4 stores two codes per byte, element 2i in the low nibble (compressed-tensors
``mxfp4-pack-quantized``); MXFP8 codes are the bits of ``torch.float8_e4m3fn``.

Every step is exact in fp32: powers of two are built from their bits, scaling is by powers of two, and the rounding
is ``torch.round`` (half to even) of a value brought onto an integer grid. ``fake_quant_*`` return dequant(quant(x))
with a straight-through gradient (quantisation-aware training).

Legend: n values along the last dim (a multiple of 32), B = n / 32 blocks.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

__all__ = ["BLOCK", "E2M1", "E4M3", "ElementFormat", "quantize_mx", "dequantize_mx", "quantize_mxfp4",
           "dequantize_mxfp4", "quantize_mxfp8", "dequantize_mxfp8", "fake_quant_mxfp4", "fake_quant_mxfp8",
           "mx_round", "encode_element", "decode_element"]

BLOCK = 32
NAN_SCALE = 255


class ElementFormat(NamedTuple):
    name: str
    ebits: int
    mbits: int
    emax: int  # floor(log2(max)): the exponent the block max is brought to
    max: float
    nan_code: int | None  # the magnitude bits of NaN, None where the format has none

    @property
    def bias(self) -> int:
        return 2 ** (self.ebits - 1) - 1

    @property
    def emin(self) -> int:  # exponent of the smallest normal
        return 1 - self.bias


E2M1 = ElementFormat("e2m1", 2, 1, 2, 6.0, None)
E4M3 = ElementFormat("e4m3", 4, 3, 8, 448.0, 0x7F)


def pow2(e: torch.Tensor) -> torch.Tensor:
    """Exact fp32 2^e for integer e in [-149, 127], built from the bits (no libm rounding)."""
    e = e.to(torch.int32)
    normal = (e + 127).clamp(min=1) << 23
    subnormal = torch.ones_like(e) << (e + 149).clamp(0, 22)
    return torch.where(e >= -126, normal, subnormal).view(torch.float32)


def _floor_log2(a: torch.Tensor) -> torch.Tensor:
    """floor(log2 a) for finite a > 0 (subnormals included), exactly: frexp gives a = m 2^x with m in [0.5, 1)."""
    return torch.frexp(a)[1] - 1


def round_to_grid(x: torch.Tensor, fmt: ElementFormat) -> torch.Tensor:
    """fp32 x -> the nearest value of the element format (ties to even), saturated at +-max; keeps -0 and NaN."""
    a = x.abs()
    e = _floor_log2(a).clamp(min=fmt.emin)  # the binade; subnormals share the smallest normal's spacing
    up = pow2(fmt.mbits - e)  # 1 / spacing of the grid in that binade
    q = (torch.round(a * up) / up).clamp(max=fmt.max)
    return torch.copysign(q, x)


def _encode(q: torch.Tensor, fmt: ElementFormat) -> torch.Tensor:
    """Values on the element grid -> their codes (uint8): sign, biased exponent, mantissa."""
    a = q.abs()
    e = _floor_log2(a)
    normal = a >= 2.0 ** fmt.emin
    ef = torch.where(normal, e + fmt.bias, 0)
    mf = torch.where(normal, a * pow2(fmt.mbits - e) - 2 ** fmt.mbits, a * 2.0 ** (fmt.mbits - fmt.emin))
    sign = torch.signbit(q).to(torch.int32) << (fmt.ebits + fmt.mbits)
    nan = torch.isnan(q)
    code = sign | (ef << fmt.mbits) | torch.where(nan, 0, mf).to(torch.int32)
    # E2M1 has no NaN: quantize_mx gives a NaN's block the NaN scale instead, and its codes are 0
    code = torch.where(nan, sign | fmt.nan_code if fmt.nan_code is not None else 0, code)
    return code.to(torch.uint8)


@functools.lru_cache(maxsize=None)
def _decode_table(fmt: ElementFormat, device: torch.device) -> torch.Tensor:
    """fp32 [2^(1 + ebits + mbits)]: the value of every code."""
    c = torch.arange(2 ** (1 + fmt.ebits + fmt.mbits), device=device)
    ef, mf = (c >> fmt.mbits) & (2 ** fmt.ebits - 1), c & (2 ** fmt.mbits - 1)
    sub = mf * 2.0 ** (fmt.emin - fmt.mbits)
    normal = (2 ** fmt.mbits + mf) * pow2(ef - fmt.bias - fmt.mbits)
    mag = torch.where(ef == 0, sub, normal)
    if fmt.nan_code is not None:
        mag = torch.where((c & (2 ** (fmt.ebits + fmt.mbits) - 1)) == fmt.nan_code, float("nan"), mag)
    return torch.where((c >> (fmt.ebits + fmt.mbits)) == 1, -mag, mag)


def encode_element(x: torch.Tensor, fmt: ElementFormat) -> torch.Tensor:
    """Unscaled values -> element codes (uint8): round to nearest even, saturate; NaN -> the NaN code (E4M3)."""
    return _encode(round_to_grid(x.float(), fmt), fmt)


def decode_element(codes: torch.Tensor, fmt: ElementFormat) -> torch.Tensor:
    """Element codes (uint8) -> fp32 values."""
    return _decode_table(fmt, codes.device)[codes.long()]


def _blocks(x: torch.Tensor, what: str) -> torch.Tensor:
    n = x.shape[-1]
    if n % BLOCK:
        raise ValueError(f"MX formats need the last dim of {what} to be a multiple of {BLOCK}; got shape "
                         f"{tuple(x.shape)}")
    return x.float().reshape(*x.shape[:-1], n // BLOCK, BLOCK)


def _block_exponents(xb: torch.Tensor, fmt: ElementFormat) -> tuple[torch.Tensor, torch.Tensor]:
    """xb [..., B, 32] fp32 -> (unbiased scale exponents [..., B] int32, mask of blocks with a NaN or Inf)."""
    amax = xb.abs().amax(-1)
    e = torch.where(amax > 0, _floor_log2(amax) - fmt.emax, -127).clamp(-127, 127)
    return e, ~torch.isfinite(amax)


def mx_round(x: torch.Tensor, fmt: ElementFormat) -> torch.Tensor:
    """dequant(quant(x)) in x's dtype without building the codes (the grid values times the block scale)."""
    xb = _blocks(x, "the tensor")
    e, bad = _block_exponents(xb, fmt)
    q = round_to_grid(xb * pow2(-e)[..., None], fmt) * pow2(e)[..., None]
    q = torch.where(bad[..., None], float("nan"), q)
    return q.reshape(x.shape).to(x.dtype)


def quantize_mx(x: torch.Tensor, fmt: ElementFormat) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., n] -> (element codes uint8 [..., n], E8M0 scales uint8 [..., B])."""
    xb = _blocks(x, "the tensor")
    e, bad = _block_exponents(xb, fmt)
    codes = _encode(round_to_grid(xb * pow2(-e)[..., None], fmt), fmt)
    codes = torch.where(bad[..., None], 0, codes).to(torch.uint8)
    scale = torch.where(bad, NAN_SCALE, e + 127).to(torch.uint8)
    return codes.reshape(x.shape), scale


def dequantize_mx(codes: torch.Tensor, scale: torch.Tensor, fmt: ElementFormat,
                  dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """(codes uint8 [..., n], scales uint8 [..., B]) -> values [..., n] in ``dtype`` (computed exactly in fp32)."""
    if codes.dtype != torch.uint8 or scale.dtype != torch.uint8:
        raise ValueError(f"MX codes and scales must be uint8; got {codes.dtype} and {scale.dtype}")
    if scale.shape != (*codes.shape[:-1], codes.shape[-1] // BLOCK) or codes.shape[-1] % BLOCK:
        raise ValueError(f"MX scales must be [..., n/{BLOCK}] for codes [..., n] (n a multiple of {BLOCK}); got codes "
                         f"{tuple(codes.shape)}, scales {tuple(scale.shape)}")
    vals = decode_element(codes, fmt).reshape(*scale.shape, BLOCK)
    x = torch.where(scale[..., None] == NAN_SCALE, float("nan"), vals * pow2(scale.to(torch.int32) - 127)[..., None])
    return x.reshape(codes.shape).to(dtype)


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., n] -> (packed uint8 [..., n/2], element 2i in the low nibble; E8M0 scales uint8 [..., n/32])."""
    codes, scale = quantize_mx(w, E2M1)
    return codes[..., 0::2] | (codes[..., 1::2] << 4), scale


def dequantize_mxfp4(packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """(packed uint8 [..., n/2], scales uint8 [..., n/32]) -> [..., n] in ``dtype``."""
    if packed.dtype != torch.uint8:
        raise ValueError(f"MXFP4 weight_packed must be uint8; got {packed.dtype}")
    codes = torch.stack([packed & 0xF, packed >> 4], dim=-1).flatten(-2)
    return dequantize_mx(codes, scale, E2M1, dtype)


def quantize_mxfp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., n] -> (E4M3 codes uint8 [..., n] (``.view(torch.float8_e4m3fn)``), E8M0 scales uint8 [..., n/32])."""
    return quantize_mx(x, E4M3)


def dequantize_mxfp8(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    return dequantize_mx(codes, scale, E4M3, dtype)


class _StraightThrough(torch.autograd.Function):
    """Forward: dequant(quant(x)); backward: the gradient passes unchanged (the straight-through estimator)."""

    @staticmethod
    def forward(ctx, x, fmt):
        return mx_round(x, fmt)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def fake_quant_mxfp4(w: torch.Tensor) -> torch.Tensor:
    """MXFP4 round trip of w (blocks along the last dim) with a straight-through gradient."""
    return _StraightThrough.apply(w, E2M1)


def fake_quant_mxfp8(x: torch.Tensor) -> torch.Tensor:
    """MXFP8 (E4M3) round trip of x (blocks along the last dim) with a straight-through gradient."""
    return _StraightThrough.apply(x, E4M3)
