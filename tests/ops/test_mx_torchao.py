"""k3.ops.mx against an independent implementation: torchao's ``mx_formats.to_mx`` / ``to_dtype`` (OCP scale rule
"FLOOR", E2M1 packed two per byte with element 2i in the low nibble, E4M3 as ``float8_e4m3fn``).

Where the two differ on purpose, the inputs avoid it (stated in the README): torchao divides by at least 2^-126
(the smallest normal) where the E8M0 scale is 2^-127, so blocks whose max is below ~2^-120 are left out; torchao
saturates an Inf where the MX reference implementation (and k3) gives the block the NaN scale (test_mx.py).
"""

import pytest
import torch

from k3.ops.mx import BLOCK, dequantize_mxfp4, dequantize_mxfp8, quantize_mxfp4, quantize_mxfp8

mx = pytest.importorskip("torchao.prototype.mx_formats.mx_tensor", reason="torchao (the `test` extra) not installed")


def _data(seed):
    torch.manual_seed(seed)
    x = torch.randn(96, 8 * BLOCK) * torch.exp2(torch.randint(-100, 100, (96, 8, 1)).float()).repeat_interleave(
        BLOCK, 1).reshape(96, -1)[:, :8 * BLOCK]
    x[:, ::5] *= 7.5  # values that saturate after scaling
    x[::3, 1::BLOCK] = 0.0
    x[1, :BLOCK] = 0.0  # an all-zero block: scale 2^-127 in both
    # exact ties of the element grids after scaling (block max 4 -> scale 1): 0.25, 2.5, 5 (E2M1); 4.5, 9 (E4M3)
    x[2, :BLOCK] = torch.tensor([4.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -2.5, -5.0] + [0.0] * 21)
    x[3, :BLOCK] = torch.tensor([256.0, 4.5, 9.0, 17.0, 2.0**-7 * 1.5, -4.5, 2.0**-9 * 3 / 2] + [0.0] * 25)
    return x


FORMATS = {"mxfp4": (quantize_mxfp4, dequantize_mxfp4, torch.float4_e2m1fn_x2),  # torchao packs E2M1 as k3 does
           "mxfp8": (quantize_mxfp8, dequantize_mxfp8, torch.float8_e4m3fn)}


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_codes_scales_and_values_equal_torchao(fmt, seed, dtype):
    quantize, dequantize, elem = FORMATS[fmt]
    x = _data(seed).to(dtype)
    codes, scale = quantize(x)
    ao_scale, ao_codes = mx.to_mx(x.contiguous(), elem, BLOCK)
    assert torch.equal(scale, ao_scale.view(torch.uint8))
    assert torch.equal(codes, ao_codes.view(torch.uint8))
    ao = mx.to_dtype(ao_codes, ao_scale, elem, BLOCK, torch.float32)
    assert torch.equal(dequantize(codes, scale, torch.float32), ao)
