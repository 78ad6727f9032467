"""The vision tower's GPU path against its reference (run on an H200 by the lead; skipped without CUDA): attention
within each packed image as one flash varlen call (bf16) equals the length-grouped SDPA reference (fp32), outputs
and gradients; and MoonViT-V2 in bf16 on CUDA gives the fp32 reference's features."""

import pytest
import torch

from k3.vision import MoonViT, VisionConfig
from k3.vision.attention import attend_images, attend_images_reference, varlen_available
from k3.vision.tower import grid_cu_seqlens
from tests.conftest import assert_close

pytestmark = pytest.mark.gpu

GRIDS = [(32, 46), (2, 2), (14, 8), (40, 40), (4, 60)]  # images of several sizes in one packed sequence


def test_varlen_attention_matches_the_reference_outputs_and_gradients():
    torch.manual_seed(0)
    T, H, D = sum(h * w for h, w in GRIDS), 12, 128
    q, k, v = (torch.randn(T, H, D, device="cuda", requires_grad=True) for _ in range(3))
    cu = grid_cu_seqlens(GRIDS, "cuda")
    assert varlen_available(q.bfloat16())
    runs = []
    for fast in (True, False):
        for t in (q, k, v):
            t.grad = None
        args = [t.bfloat16() if fast else t for t in (q, k, v)]
        o = (attend_images if fast else attend_images_reference)(*args, cu)
        o.float().pow(2).mean().backward()
        runs.append((o.float(), [t.grad.clone() for t in (q, k, v)]))
    (o1, g1), (o0, g0) = runs
    assert_close("output", o0, o1, 1e-2)
    for name, a, b in zip("qkv", g0, g1):
        assert_close(f"d{name}", a, b, 2e-2)


def test_moonvit_v2_in_bf16_matches_fp32():
    torch.manual_seed(0)
    tower = MoonViT(VisionConfig.preset("moonvit-v2").replace(vt_num_hidden_layers=4)).cuda()
    for p in tower.parameters():
        torch.nn.init.normal_(p, std=0.02)
    pixels = torch.randn(sum(h * w for h, w in GRIDS[:3]), 3, 14, 14, device="cuda")
    with torch.no_grad():
        ref = tower(pixels, GRIDS[:3])
        fast = tower.to(torch.bfloat16)(pixels, GRIDS[:3])
    assert_close("features", ref, fast.float(), 3e-2)
