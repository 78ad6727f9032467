"""k3.ops.mx against the OCP MX v1.0 rules: every E2M1 and E4M3 code, ties to even, saturation, the E8M0 scale,
zero / subnormal / NaN / Inf blocks, the MXFP4 nibble order, fake quant and its straight-through gradient.

Oracles independent of the code under test: a hand-written E2M1 table, torch's own ``float8_e4m3fn`` (decode of
all 256 codes; its RNE saturating cast for every element) and ``float8_e8m0fnu`` (all 256 scales), and the scale
rule evaluated with Python's ``math.frexp``. tests/ops/test_mx_torchao.py compares with torchao's mx_formats.
"""

import math

import pytest
import torch

from k3.ops.mx import (BLOCK, E2M1, E4M3, decode_element, dequantize_mx, dequantize_mxfp4, dequantize_mxfp8,
                       encode_element, fake_quant_mxfp4, fake_quant_mxfp8, mx_round, quantize_mx, quantize_mxfp4,
                       quantize_mxfp8)

# OCP MX v1.0 table 6 (E2M1): codes 0..7 positive, 8..15 their negatives (8 is -0)
E2M1_TABLE = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]
ALL8 = torch.arange(256, dtype=torch.uint8)
ALL4 = torch.arange(16, dtype=torch.uint8)


def _bits_equal(a, b):
    """Equal including the sign of zero and NaN positions."""
    a, b = a.float(), b.float()
    same = (a == b) & (torch.signbit(a) == torch.signbit(b))
    return bool((same | (a.isnan() & b.isnan())).all())


# ---------------------------------------------------------------- elements


def test_every_e2m1_code_decodes_to_the_spec_table():
    assert _bits_equal(decode_element(ALL4, E2M1), torch.tensor(E2M1_TABLE))


def test_every_e4m3_code_decodes_as_torch_float8_e4m3fn():
    ours = decode_element(ALL8, E4M3)
    assert _bits_equal(ours, ALL8.view(torch.float8_e4m3fn).float())
    assert ours[0x7E] == 448 and ours[0x01] == 2.0**-9 and ours[0x08] == 2.0**-6 and ours[0x38] == 1.0
    assert ours[0x7F].isnan() and ours[0xFF].isnan() and int(ours.isnan().sum()) == 2  # "fn": no Inf, one NaN


@pytest.mark.parametrize("fmt, codes", [(E2M1, ALL4), (E4M3, ALL8)], ids=["e2m1", "e4m3"])
def test_every_representable_value_encodes_to_its_code(fmt, codes):
    vals = decode_element(codes, fmt)
    keep = ~vals.isnan()
    assert torch.equal(encode_element(vals[keep], fmt), codes[keep])  # +-0 keep their sign codes


def _positive_grid(fmt):
    v = decode_element(ALL8 if fmt is E4M3 else ALL4, fmt)
    return torch.unique(v[(v >= 0) & ~v.isnan()])  # sorted, +0 once


@pytest.mark.parametrize("fmt", [E2M1, E4M3], ids=["e2m1", "e4m3"])
def test_midpoints_round_to_the_even_code_and_neighbours_to_the_nearest(fmt):
    grid = _positive_grid(fmt)
    lo, hi = grid[:-1], grid[1:]
    mid = (lo + hi) / 2  # exact in fp32
    got = encode_element(mid, fmt)
    code_lo, code_hi = encode_element(lo, fmt), encode_element(hi, fmt)
    want = torch.where(code_lo % 2 == 0, code_lo, code_hi)  # the even mantissa (exactly one of two neighbours)
    assert torch.equal(got, want)
    assert torch.equal(encode_element(-mid, fmt), want | (1 << (fmt.ebits + fmt.mbits)))  # symmetric
    eps = (hi - lo) / 8
    assert torch.equal(encode_element(mid - eps, fmt), code_lo) and torch.equal(encode_element(mid + eps, fmt), code_hi)
    if fmt is E4M3:  # torch's own cast rounds to nearest even too
        assert torch.equal(got, mid.to(torch.float8_e4m3fn).view(torch.uint8))


@pytest.mark.parametrize("fmt, over", [(E2M1, [6.5, 7.0, 8.0, 1e30, float("inf")]),
                                       (E4M3, [449.0, 464.0, 480.0, 1e6, float("inf")])], ids=["e2m1", "e4m3"])
def test_values_beyond_the_max_saturate(fmt, over):
    x = torch.tensor(over)
    assert torch.equal(decode_element(encode_element(x, fmt), fmt), torch.full_like(x, fmt.max))
    assert torch.equal(decode_element(encode_element(-x, fmt), fmt), torch.full_like(x, -fmt.max))
    if fmt is E4M3:  # the code of 448 (torch's own cast of out-of-range values saturates in 2.13, gives NaN in 2.11)
        assert torch.equal(encode_element(x, fmt), x.clamp(max=fmt.max).to(torch.float8_e4m3fn).view(torch.uint8))


def test_e4m3_subnormals_and_underflow():
    tiny = torch.tensor([2.0**-9, 3 * 2.0**-10, 2.0**-10, 2.0**-11, 7 * 2.0**-9])
    # 3*2^-10 is the midpoint of 2^-9 (code 1) and 2^-8 (code 2): even -> 2; 2^-10 is half the smallest: even -> 0
    assert encode_element(tiny, E4M3).tolist() == [1, 2, 0, 0, 7]
    assert torch.equal(encode_element(tiny, E4M3), tiny.to(torch.float8_e4m3fn).view(torch.uint8))


def test_nan_elements():
    nan = torch.tensor([float("nan")])
    assert decode_element(encode_element(nan, E4M3), E4M3).isnan().all()


# ---------------------------------------------------------------- blocks: scale, specials


def _ocp_scale_code(block, emax):
    """The spec's rule on Python floats: 127 + clamp(floor(log2 amax) - emax, -127, 127); 255 for NaN/Inf."""
    amax = max(abs(v) for v in block)
    if math.isnan(amax) or math.isinf(amax):
        return 255
    if amax == 0:
        return 0
    m, e = math.frexp(amax)  # amax = m 2^e, m in [0.5, 1)
    return 127 + max(-127, min(127, e - 1 - emax))


@pytest.mark.parametrize("fmt", [E2M1, E4M3], ids=["e2m1", "e4m3"])
def test_block_scale_follows_the_spec_rule(fmt):
    torch.manual_seed(0)
    mags = [2.0**k * f for k in (-140, -130, -126, -100, -20, -1, 0, 1, 5, 100, 127) for f in (1.0, 1.5, 1.999999)]
    rows = torch.randn(len(mags), BLOCK)
    rows = rows / rows.abs().amax(1, keepdim=True) * torch.tensor(mags)[:, None]
    _, scale = quantize_mx(rows, fmt)
    want = [_ocp_scale_code(r.tolist(), fmt.emax) for r in rows]
    assert scale.reshape(-1).tolist() == want


def test_e8m0_scales_decode_as_torch_float8_e8m0fnu():
    codes = torch.full((256, BLOCK), 2, dtype=torch.uint8)  # every element 1.0 (E2M1 code 2)
    got = dequantize_mx(codes, ALL8[:, None], E2M1)[:, 0]
    assert _bits_equal(got, ALL8.view(torch.float8_e8m0fnu).float())  # 2^(s-127), 2^-127 at 0, NaN at 255


def test_zero_nan_and_inf_blocks():
    x = torch.randn(4, 2 * BLOCK)
    x[0, :BLOCK] = 0.0
    x[0, 3] = -0.0
    x[1, 5] = float("nan")
    x[2, BLOCK + 7] = float("inf")
    x[3, 0] = -float("inf")
    for fmt in (E2M1, E4M3):
        codes, scale = quantize_mx(x, fmt)
        assert scale.tolist()[0][0] == 0 and scale[1, 0] == 255 and scale[2, 1] == 255 and scale[3, 0] == 255
        y = dequantize_mx(codes, scale, fmt)
        assert (y[0, :BLOCK] == 0).all() and torch.signbit(y[0, 3])  # -0 keeps its sign
        assert y[1, :BLOCK].isnan().all() and y[2, BLOCK:].isnan().all() and y[3, :BLOCK].isnan().all()
        clean = torch.tensor([[0, 1], [1, 0], [0, 1]]).bool()  # blocks of rows 1..3 without a special value
        assert not y[1:].reshape(3, 2, BLOCK)[clean].isnan().any()
        assert _bits_equal(mx_round(x, fmt), y)


def test_blocks_below_the_smallest_scale_lose_what_the_elements_cannot_hold():
    x = torch.zeros(2, BLOCK)
    x[0, :3] = torch.tensor([2.0**-149, 2.0**-130, -(2.0**-128)])  # scale clamps to 2^-127
    x[1, :2] = torch.tensor([2.0**-120, 2.0**-125])  # E4M3: 2^-120 / 2^-127 = 128, 2^-125 -> 4
    c4, s4 = quantize_mx(x, E2M1)
    assert s4.tolist() == [[0], [127 - 120 - 2]]
    assert dequantize_mx(c4, s4, E2M1)[0, :3].tolist() == [0.0, 0.0, -(2.0**-128)]  # 0.5 * 2^-127
    c8, s8 = quantize_mx(x, E4M3)
    assert s8.tolist() == [[0], [0]]
    assert dequantize_mx(c8, s8, E4M3)[1, :2].tolist() == [2.0**-120, 2.0**-125]


# ---------------------------------------------------------------- MXFP8 against torch's float8_e4m3fn cast


def test_mxfp8_equals_the_scale_rule_then_torchs_e4m3_cast():
    torch.manual_seed(0)
    x = torch.randn(64, 8 * BLOCK) * torch.exp2(torch.randint(-30, 30, (64, 1)).float())
    x[:, ::7] *= 200  # saturating blocks
    codes, scale = quantize_mxfp8(x)
    xb = x.reshape(64, 8, BLOCK)
    want_scale = torch.tensor([[_ocp_scale_code(b.tolist(), 8) for b in row] for row in xb])
    assert torch.equal(scale.long(), want_scale)
    X = torch.exp2(want_scale.double() - 127).float()[..., None]
    # saturating, as the OCP MX conversion we implement (torch's cast of values past 448 is NaN in torch 2.11)
    want = (xb / X).clamp(-E4M3.max, E4M3.max).to(torch.float8_e4m3fn).view(torch.uint8).reshape(64, -1)
    assert torch.equal(codes, want)
    assert torch.equal(dequantize_mxfp8(codes, scale, torch.float32), mx_round(x, E4M3))


# ---------------------------------------------------------------- MXFP4 packing


def test_mxfp4_packs_element_2i_in_the_low_nibble():
    w = torch.zeros(1, BLOCK)
    w[0, :4] = torch.tensor([1.0, 6.0, -0.5, 3.0])  # amax 6: scale 2^0
    packed, scale = quantize_mxfp4(w)
    assert packed.shape == (1, BLOCK // 2) and scale.tolist() == [[127]]
    assert packed[0, 0] == 2 | (7 << 4) and packed[0, 1] == 9 | (5 << 4)
    assert torch.equal(dequantize_mxfp4(packed, scale, torch.float32), w)


def test_mxfp4_and_mxfp8_work_on_expert_banks_and_reject_bad_shapes():
    torch.manual_seed(0)
    w = torch.randn(3, 8, 2 * BLOCK)  # [E, out, in]
    packed, scale = quantize_mxfp4(w)
    assert packed.shape == (3, 8, BLOCK) and scale.shape == (3, 8, 2)
    for e in range(3):  # a bank quantises expert by expert
        p, s = quantize_mxfp4(w[e])
        assert torch.equal(packed[e], p) and torch.equal(scale[e], s)
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize_mxfp4(torch.randn(4, 48))
    with pytest.raises(ValueError, match="uint8"):
        dequantize_mxfp4(packed.int(), scale)
    with pytest.raises(ValueError, match=r"scales must be \[\.\.\., n/32\]"):
        dequantize_mxfp4(packed, scale[..., :1])


def test_representable_weights_round_trip_exactly():
    torch.manual_seed(0)
    vals = torch.tensor(E2M1_TABLE)[torch.randint(0, 16, (16, 4 * BLOCK))]
    vals[:, ::BLOCK] = 6.0  # every block reaches the max: scale 2^(k) exactly below
    w = vals * torch.exp2(torch.randint(-20, 20, (16, 4)).float()).repeat_interleave(BLOCK, 1)
    p, s = quantize_mxfp4(w)
    assert torch.equal(dequantize_mxfp4(p, s, torch.float32), w)


# ---------------------------------------------------------------- fake quant (QAT)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fake_quant_is_dequant_of_quant(dtype):
    torch.manual_seed(0)
    x = (torch.randn(16, 4 * BLOCK) * 3).to(dtype)
    x[0, 0] = float("nan")
    p, s = quantize_mxfp4(x)
    assert _bits_equal(fake_quant_mxfp4(x), dequantize_mxfp4(p, s, dtype))
    c, s8 = quantize_mxfp8(x)
    assert _bits_equal(fake_quant_mxfp8(x), dequantize_mxfp8(c, s8, dtype))
    assert fake_quant_mxfp4(x).dtype == dtype


def test_straight_through_gradient_is_the_gradient_at_the_quantised_value():
    """d/dw f(fq(w)) with the STE equals d/dq f(q) at q = fq(w), the unquantised gradient w.r.t. the fake-quant
    output, for weights and activations."""
    torch.manual_seed(0)
    w = torch.randn(8, 2 * BLOCK, requires_grad=True)
    x = torch.randn(5, 2 * BLOCK, requires_grad=True)
    (torch.tanh(fake_quant_mxfp8(x) @ fake_quant_mxfp4(w).T) ** 2).sum().backward()
    wq = mx_round(w.detach(), E2M1).requires_grad_()
    xq = mx_round(x.detach(), E4M3).requires_grad_()
    (torch.tanh(xq @ wq.T) ** 2).sum().backward()
    assert torch.equal(w.grad, wq.grad) and torch.equal(x.grad, xq.grad)


@pytest.mark.gpu
def test_cuda_equals_cpu_bitwise():
    torch.manual_seed(0)
    x = torch.randn(64, 8 * BLOCK) * torch.exp2(torch.randint(-40, 40, (64, 1)).float())
    x[3, 5] = float("nan")
    for fn in (quantize_mxfp4, quantize_mxfp8):
        for a, b in zip(fn(x), fn(x.cuda())):
            assert torch.equal(a, b.cpu())
    for fmt in (E2M1, E4M3):
        assert _bits_equal(mx_round(x, fmt), mx_round(x.cuda(), fmt).cpu())
        assert _bits_equal(mx_round(x.bfloat16(), fmt), mx_round(x.bfloat16().cuda(), fmt).cpu())
