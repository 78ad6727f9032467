"""The decode step's fused output projections (k3.ops.proj_decode) against the unfused path: each kernel against
its reference math, then each layer's decode path (LatentMoE, KDA's output) against the layer's general path.
Triton's interpreter on CPU (tests/conftest.py) in fp32, compiled on a GPU in fp32 and bf16."""

import importlib.util

import pytest
import torch
import torch.nn.functional as F

from k3 import K3Config
from k3.ops.norms import gated_rms_norm, rms_norm
from k3.ops.proj_decode import kda_output_decode, moe_output_decode
from k3.ops.situ import glu

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")
DEV = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, pytest.param(torch.bfloat16, marks=pytest.mark.skipif(DEV != "cuda",
                                                                                reason="bf16: compiled Triton only"))]


def _tol(dtype):
    return dict(atol=2e-5, rtol=1e-4) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("N,k,L,Is,Dout,act,norm", [(1, 4, 40, 24, 36, "situ", True), (3, 2, 300, 0, 70, "silu", True),
                                                    (5, 8, 64, 48, 16, "situ", False)])
def test_moe_output_kernel_is_sum_norm_activation_then_the_matmul(N, k, L, Is, Dout, act, norm, dtype):
    """y = W [round(RMSNorm(sum_j parts_j) w) ; round(glu(gate, up))], the shared experts' gate and up read as
    columns of a wider row (the fused input projection's output)."""
    g = torch.Generator().manual_seed(0)
    parts = torch.randn(N, k, L, generator=g).to(DEV)
    gate_up = (torch.randn(N, 5 + L + 2 * Is + 3, generator=g) * 3).to(DEV, dtype)[:, 5:]  # strided rows
    nw = (torch.rand(L, generator=g) + 0.5).to(DEV, dtype) if norm else None
    W = (torch.randn(Dout, L + Is, generator=g) / (L + Is) ** 0.5).to(DEV, dtype)
    u = parts.sum(1)
    u = (rms_norm(u, nw, 1e-5) if norm else u).to(dtype)
    x = torch.cat([u, glu(gate_up[:, L:L + Is], gate_up[:, L + Is:L + 2 * Is], act, 4.0, 25.0)], -1) if Is else u
    ref = F.linear(x, W)
    with torch.no_grad():
        out = moe_output_decode(parts, gate_up if Is else None, L, L + Is, Is, nw, 1e-5, W, act, 4.0, 25.0)
    assert out.dtype == dtype and out.shape == (N, Dout)
    torch.testing.assert_close(out, ref, **_tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("N,H,K,Dout", [(1, 3, 32, 40), (4, 2, 48, 64)])
def test_kda_output_kernel_is_the_gated_head_norm_then_o_proj(N, H, K, Dout, dtype):
    g = torch.Generator().manual_seed(1)
    o = torch.randn(N, H, K, generator=g).to(DEV, dtype)
    gate = (torch.randn(N, 7 + H * K, generator=g) * 2).to(DEV, dtype)[:, 7:]  # strided rows, as the projection's
    w = (torch.rand(K, generator=g) + 0.5).to(DEV)
    W = (torch.randn(Dout, H * K, generator=g) / (H * K) ** 0.5).to(DEV, dtype)
    ref = F.linear(gated_rms_norm(o, gate.reshape(N, H, K), w, 1e-5).reshape(N, H * K).to(dtype), W)
    with torch.no_grad():
        out = kda_output_decode(o, gate, w, 1e-5, W)
    assert out.dtype == dtype
    torch.testing.assert_close(out, ref, **_tol(dtype))


def _decode_paths_on(monkeypatch):
    """On CPU the fused paths run only under the interpreter, and only when told to: their checks ask for CUDA."""
    if DEV == "cpu":
        import k3.inference.fast as fast

        def applies(x, rows, max_rows, weight, width):
            return not torch.is_grad_enabled() and rows <= max_rows and width <= 4096

        monkeypatch.setattr(fast, "proj_decode_applies", applies)
        monkeypatch.setattr(fast, "decode_applies", lambda z, idx: not torch.is_grad_enabled())


@pytest.mark.parametrize("N", [1, 2])
def test_latent_moe_decode_path_equals_its_general_path(N, monkeypatch):
    """LatentMoE with fused projections at a decode step's rows: expert kernels + the one output kernel == the
    grouped experts, the latent norm, the shared experts and the fused output matmul (the layer's own forward)."""
    from k3.inference.fast import moe_ffn
    from k3.layers.width.latent_moe import LatentMoE

    torch.manual_seed(0)
    moe = LatentMoE(K3Config.preset("tiny")).to(DEV)
    moe.fuse_projections()
    x = torch.randn(N, 1, moe.gate.weight.shape[1], device=DEV) * 2
    ref = moe(x).detach()  # the layer's own forward: the general path
    _decode_paths_on(monkeypatch)
    calls = []
    import k3.inference.fast as mod
    real = mod.moe_output_decode
    monkeypatch.setattr(mod, "moe_output_decode", lambda *a: calls.append(1) or real(*a))
    with torch.no_grad():
        out = moe_ffn(moe, x)
    assert calls, "the fused output kernel did not run"
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)


def test_kda_decode_output_equals_its_general_path(monkeypatch):
    from k3.inference.fast import kda_output
    from k3.layers.sequence.kda import KimiDeltaAttention

    torch.manual_seed(0)
    cfg = K3Config.preset("tiny")
    attn = KimiDeltaAttention(cfg, 1).to(DEV)
    H, K = cfg.kda_num_heads, cfg.kda_head_dim
    o = torch.randn(3, 1, H, K, device=DEV)
    gate = torch.randn(3, 1, H * K + 5, device=DEV)[..., 5:]
    ref = attn.output(o, gate).detach()
    _decode_paths_on(monkeypatch)
    calls = []
    import k3.inference.fast as mod
    real = mod.kda_output_decode
    monkeypatch.setattr(mod, "kda_output_decode", lambda *a: calls.append(1) or real(*a))
    with torch.no_grad():
        out = kda_output(attn, o, gate)
    assert calls, "the fused output kernel did not run"
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)


def test_more_rows_than_the_limit_take_the_unfused_path(monkeypatch):
    from k3.inference.fast import moe_ffn
    from k3.layers.width.latent_moe import LatentMoE
    from k3.ops.proj_decode import MOE_ROWS

    moe = LatentMoE(K3Config.preset("tiny")).to(DEV)
    moe.fuse_projections()
    _decode_paths_on(monkeypatch)
    import k3.inference.fast as mod
    monkeypatch.setattr(mod, "moe_output_decode", lambda *a: pytest.fail("fused past MOE_ROWS"))
    with torch.no_grad():
        moe_ffn(moe, torch.randn(MOE_ROWS + 1, 1, moe.gate.weight.shape[1], device=DEV))
