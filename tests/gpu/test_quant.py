"""The packed-expert path on CUDA (run on the H200 through the device tool): the Triton packed grouped matmul
against the pure-torch reference (fp32: summation order only; bf16: bf16 rounding of the inputs' products), and the
`small` model served packed against its QAT (fake-quant) training forward, in bf16 (stated tolerance: logits RMS
ratio 2e-2, the bf16 grouped matmuls of the two paths round differently)."""

import pytest
import torch

from k3 import K3Config, K3ForCausalLM
from k3.ops.mx import quantize_mxfp4
from k3.quant import pack_experts
from k3.quant.packed import packed_grouped_mm_reference
from tests.conftest import assert_close

pytestmark = pytest.mark.gpu
triton_mm = pytest.importorskip("k3.quant.triton_mm", reason="needs triton")


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-6), (torch.bfloat16, 1e-2)], ids=["fp32", "bf16"])
@pytest.mark.parametrize("M", [8, 300, 5000])
def test_triton_packed_grouped_mm_matches_the_reference(dtype, tol, M):
    torch.manual_seed(0)
    E, N, K = 32, 384, 384
    packed, scale = quantize_mxfp4(torch.randn(E, N, K, device="cuda"))
    counts = torch.bincount(torch.randint(0, E, (M,), device="cuda"), minlength=E)
    counts[3] = 0
    x = torch.randn(int(counts.sum()), K, device="cuda", dtype=dtype)
    got = triton_mm.triton_packed_grouped_mm(x, packed, scale, counts)
    want = packed_grouped_mm_reference(x.float(), packed, scale, counts)
    assert got.dtype == dtype
    assert_close(f"packed grouped mm M{M} {dtype}", want, got, tol)


def test_small_served_packed_matches_the_qat_forward_on_cuda():
    torch.manual_seed(0)
    cfg = K3Config.preset("small").replace(qat="mxfp4", vocab_size=4096, num_nextn_predict_layers=0)
    qat = K3ForCausalLM(cfg).cuda().to(torch.bfloat16).eval()
    ids = torch.randint(0, cfg.vocab_size, (2, 256), device="cuda")
    with torch.no_grad():
        want = qat(ids)["logits"]
        served = pack_experts(qat)
        got = served(ids)["logits"]
    assert_close("small packed vs QAT logits (bf16)", want, got, 2e-2)
