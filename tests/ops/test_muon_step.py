"""Muon's fused elementwise passes (k3.ops.muon_step) against their torch-op reference, on every block layout
Muon uses (whole, per-head rows and columns, experts, tall blocks seen transposed); then whole Muon steps: through
the kernels == through the reference, and == the update rule written out (buf, Nesterov, Newton-Schulz, decay).
Triton's interpreter on CPU (tests/conftest.py) in fp32, compiled on a GPU."""

import copy
import importlib.util
import math

import pytest
import torch

import k3.ops.muon_step as ms
from k3 import K3Config, K3ForCausalLM
from k3.train.optim import build_optimizer, newton_schulz
from k3.train.optim.muon import Muon, _blocks

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")
DEV = "cuda" if torch.cuda.is_available() else "cpu"
FUSED_APPLIES = ms.fused_applies
# (weight shape, split kind, H): the block views are contiguous, strided (columns per head) or transposed (tall)
LAYOUTS = [((40, 24), "whole", 1), ((48, 20), "rows", 4), ((24, 36), "cols", 3), ((4, 40, 8), "experts", 4),
           ((4, 8, 40), "experts", 4), ((70, 130), "whole", 1)]


def _tol():
    return dict(atol=1e-6, rtol=1e-5)


@needs_triton
def test_momentum_kernel_is_the_two_lerps_and_the_cast_into_the_slots():
    """Every layout in one call (tensors of different shapes, strides and momenta; Nesterov on some; C- and
    R-contiguous views each one launch)."""
    from k3.ops._muon_triton import momentum

    g0 = [torch.randn(shape, device=DEV) for shape, _, _ in LAYOUTS]
    b0 = [torch.randn(shape, device=DEV) for shape, _, _ in LAYOUTS]
    b1, b2 = [b.clone() for b in b0], [b.clone() for b in b0]
    views = lambda ts: [_blocks(t, kind, H) for t, (_, kind, H) in zip(ts, LAYOUTS)]  # noqa: E731
    mus = [0.95, 0.9, 0.8, 0.95, 0.5, 0.99]
    nest = [True, False, True, True, False, True]
    ref = [torch.empty(v.shape, device=DEV) for v in views(g0)]
    for g, b, s, mu, n in zip(views(g0), views(b1), ref, mus, nest):
        b.lerp_(g, 1 - mu)
        s.copy_(torch.lerp(g, b, mu) if n else b)
    slots = [torch.empty(v.shape, device=DEV) for v in views(g0)]
    g_before = [g.clone() for g in g0]
    momentum(views(g0), views(b2), slots, mus, nest)
    for i in range(len(LAYOUTS)):
        torch.testing.assert_close(b2[i], b1[i], **_tol(), msg=str(LAYOUTS[i]))
        torch.testing.assert_close(slots[i], ref[i], **_tol(), msg=str(LAYOUTS[i]))
        torch.testing.assert_close(g0[i], g_before[i], atol=0, rtol=0)  # the gradient is read, not written


@needs_triton
def test_momentum_with_a_scale_is_the_momentum_of_the_scaled_gradients():
    """``scale`` (gradient clipping's coefficient, a device scalar) read in the kernel == the kernel over gradients
    scaled beforehand == the torch-op reference (on CPU tensors), which multiplies first; the gradients are left as
    they were."""
    from k3.ops._muon_triton import momentum

    g0 = [torch.randn(shape, device=DEV) for shape, _, _ in LAYOUTS]
    b0 = [torch.randn(shape, device=DEV) for shape, _, _ in LAYOUTS]
    views = lambda ts: [_blocks(t, kind, H) for t, (_, kind, H) in zip(ts, LAYOUTS)]  # noqa: E731
    mus, nest = [0.95] * len(LAYOUTS), [True, False] * (len(LAYOUTS) // 2)

    def run(step, grads, scale, device=DEV):
        g, b = [x.to(device, copy=True) for x in grads], [x.to(device, copy=True) for x in b0]
        slots = [torch.empty(v.shape, device=device) for v in views(g)]
        step(views(g), views(b), slots, mus, nest, *([scale.to(device)] if scale is not None else []))
        return g, b, slots

    scale = torch.tensor(0.37, device=DEV)
    g, *kernel = run(momentum, g0, scale)
    _, *before = run(momentum, [x * scale for x in g0], None)
    _, *ref = run(ms.momentum_into, g0, scale, "cpu")
    for i in range(len(LAYOUTS)):
        for got, want in ((kernel, before), (kernel, ref)):
            torch.testing.assert_close(got[0][i].cpu(), want[0][i].cpu(), **_tol(), msg=str(LAYOUTS[i]))
            torch.testing.assert_close(got[1][i].cpu(), want[1][i].cpu(), **_tol(), msg=str(LAYOUTS[i]))
        assert torch.equal(g[i], g0[i])
    with pytest.raises(ValueError, match="scale must be one number"):
        run(ms.momentum_into, g0, torch.ones(2, device=DEV))


@needs_triton
@pytest.mark.parametrize("shape", [(5, 40, 70), (3, 200, 250)])  # one chunk per block; several (S = 4), one partial
def test_newton_schulz_normalisation_kernel_is_each_block_over_its_frobenius_norm(shape):
    """X_n = G_n / max(||G_n||_F, eps), cast to the batch's dtype; a zero block stays zero (eps)."""
    from k3.ops._muon_triton import normalize_blocks

    G = torch.randn(shape, device=DEV) * torch.arange(shape[0], device=DEV)[:, None, None]  # block 0 all zeros
    want = G / torch.linalg.vector_norm(G, dim=(-2, -1), keepdim=True).clamp(min=1e-7)
    torch.testing.assert_close(normalize_blocks(G, 1e-7, torch.float32), want, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(normalize_blocks(G, 1e-7, torch.bfloat16), want.bfloat16(), atol=4e-3, rtol=8e-3)
    assert torch.equal(normalize_blocks(G, 1e-7, torch.float32)[0], torch.zeros(shape[1:], device=DEV))
    torch.testing.assert_close(ms.normalized_blocks(G.cpu(), 1e-7, torch.float32), want.cpu(), atol=1e-6, rtol=1e-5)


@needs_triton
def test_newton_schulz_polynomial_kernel_is_a_identity_plus_b_gram():
    from k3.ops._muon_triton import ns_poly

    gram = torch.randn(3, 37, 37, device=DEV)
    want = 2.5 * gram + 3.4445 * torch.eye(37, device=DEV)
    torch.testing.assert_close(ns_poly(gram, 3.4445, 2.5), want, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(ms.ns_polynomial(gram.cpu(), 3.4445, 2.5), want.cpu(), atol=1e-6, rtol=1e-5)
    with pytest.raises(ValueError, match="square blocks"):
        ms.ns_polynomial(torch.zeros(2, 3, 4), 1.0, 1.0)


@needs_triton
def test_update_kernel_adds_each_slot_into_its_weight_through_its_view():
    from k3.ops._muon_triton import update

    p0 = [torch.randn(shape, device=DEV) for shape, _, _ in LAYOUTS]
    ref, out = [p.clone() for p in p0], [p.clone() for p in p0]
    slots = [torch.randn(_blocks(p, kind, H).shape, device=DEV) for p, (_, kind, H) in zip(p0, LAYOUTS)]
    decays, alphas = [0.99, 1.0, 0.9, 0.999, 0.98, 0.97], [-0.3, -0.01, 0.2, -1.0, -0.5, -0.05]
    for p, s, d, a, (_, kind, H) in zip(ref, slots, decays, alphas, LAYOUTS):
        _blocks(p, kind, H).mul_(d).add_(s, alpha=a)
    update([_blocks(p, kind, H) for p, (_, kind, H) in zip(out, LAYOUTS)], slots, decays, alphas)
    for i in range(len(LAYOUTS)):
        torch.testing.assert_close(out[i], ref[i], **_tol(), msg=str(LAYOUTS[i]))


def test_views_of_another_layout_a_strided_slot_or_uneven_lists_are_refused():
    g = torch.randn(3, 8, 16)
    with pytest.raises(ValueError, match="one layout"):
        ms.momentum_into([g], [torch.randn(3, 16, 8).mT], [torch.empty(3, 8, 16)], [0.9], [True])
    with pytest.raises(ValueError, match="contiguous"):
        ms.apply_update([g], [torch.empty(3, 16, 8).mT], [1.0], [1.0])
    with pytest.raises(ValueError, match="different lengths"):
        ms.apply_update([g, g], [torch.empty(3, 8, 16)], [1.0], [1.0])


@needs_triton
def test_both_kernels_take_views_with_neither_axis_contiguous_beside_plain_ones():
    """A view strided on every axis (the kernels' third memory order) in the same call as a contiguous one and a
    transposed one: each element through its own address."""
    from k3.ops._muon_triton import momentum, update

    torch.manual_seed(2)
    bases = [(5, 70, 90), (3, 20, 30), (2, 40, 16)]
    cut = [lambda t: t[:, ::2, 1::3], lambda t: t, lambda t: t.mT]  # strides (6300, 180, 3); contiguous; (640, 1, 16)
    g, b = [torch.randn(s, device=DEV) for s in bases], [torch.randn(s, device=DEV) for s in bases]
    b_ref = [x.clone() for x in b]
    gv, bv, rv = ([c(t) for c, t in zip(cut, ts)] for ts in (g, b, b_ref))
    slots = [torch.empty(v.shape, device=DEV) for v in gv]
    momentum(gv, bv, slots, [0.9, 0.8, 0.95], [True, False, True])
    for x, y, r, s, mu, n in zip(gv, bv, rv, slots, [0.9, 0.8, 0.95], [True, False, True]):
        r.lerp_(x, 1 - mu)
        torch.testing.assert_close(y, r, **_tol())
        torch.testing.assert_close(s, torch.lerp(x, r, mu) if n else r, **_tol())
    w = [torch.randn(s, device=DEV) for s in bases]
    w_ref = [x.clone() for x in w]
    update([c(t) for c, t in zip(cut, w)], slots, [0.99, 0.9, 1.0], [-0.1, 0.5, -2.0])
    for c, x, r, s, d, a in zip(cut, w, w_ref, slots, [0.99, 0.9, 1.0], [-0.1, 0.5, -2.0]):
        c(r).mul_(d).add_(s, alpha=a)
        torch.testing.assert_close(x, r, **_tol())


class _Shard(torch.Tensor):  # a tensor subclass, as DTensor is
    pass


def test_the_kernels_take_parameters_and_plain_tensors_not_subclasses():
    """A whole expert bank's view is the Parameter itself: it must take the kernels (it once fell back)."""
    w = torch.nn.Parameter(torch.randn(4, 8, 8))
    assert ms.kernel_types([w, w.detach(), w.mT])
    tall = torch.nn.Parameter(torch.randn(4, 16, 8))
    assert ms.kernel_types([_blocks(w, "experts", 4), _blocks(tall, "experts", 4)])
    assert not ms.kernel_types([w, torch.randn(4, 8, 8).as_subclass(_Shard)])


TINY = K3Config.preset("tiny")


def _two_steps(model, grads, monkeypatch, fused):
    """Two steps with Muon's passes through the bucket kernels (``fused``; on CPU in Triton's interpreter) or
    through the reference's torch ops."""
    calls = []
    kernels = ms.kernel_types if DEV == "cpu" else FUSED_APPLIES  # on CPU the interpreter takes CPU tensors
    monkeypatch.setattr(ms, "fused_applies", lambda ts: calls.append(kernels(ts) if fused else False) or calls[-1])
    opt = build_optimizer(model, lr=1e-2)
    for gs in grads:
        for n, p in model.named_parameters():
            p.grad = gs[n].clone()
        opt.step()
    assert calls and all(calls) == fused  # every pass of every bucket took the path asked for
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.slow
@needs_triton
def test_a_muon_step_through_the_kernels_equals_the_reference(monkeypatch):
    """fp32 on CPU: equal to rounding; on CUDA both fill a bf16 batch, so one bf16 rounding of the direction may
    differ (atol ~ lr 0.2 sqrt(n) 2^-8)."""
    torch.manual_seed(0)
    model = K3ForCausalLM(TINY).to(DEV)
    grads = [{n: torch.randn_like(p) for n, p in model.named_parameters()} for _ in range(2)]
    ref = _two_steps(copy.deepcopy(model), grads, monkeypatch, fused=False)
    out = _two_steps(copy.deepcopy(model), grads, monkeypatch, fused=True)
    tol = _tol() if DEV == "cpu" else dict(atol=5e-4, rtol=1e-3)
    for n in ref:
        torch.testing.assert_close(out[n], ref[n], **tol, msg=n)


@pytest.mark.parametrize("shape,split", [((40, 24), "whole"), ((48, 20), "rows:4"), ((24, 36), "cols:3"),
                                         ((4, 40, 8), "experts")])
def test_two_muon_steps_are_the_update_rule_written_out(shape, split):
    """buf <- lerp(buf, g, 1 - mu); u <- lerp(g, buf, mu); p <- p (1 - lr wd) - lr 0.2 sqrt(max(A, B)) NS(u), each
    head or expert its own block."""
    torch.manual_seed(1)
    w = torch.nn.Parameter(torch.randn(shape))
    p, buf = w.detach().clone(), torch.zeros(shape)
    opt = Muon([{"params": [w], "split": split}], lr=1e-2, weight_decay=0.1)
    kind, _, heads = split.partition(":")
    H = int(heads) if heads else (shape[0] if kind == "experts" else 1)
    for _ in range(2):
        g = torch.randn(shape)
        w.grad = g.clone()
        opt.step()
        buf = torch.lerp(buf, g, 0.05)
        u = torch.lerp(g, buf, 0.95)
        blocks = [b for b in _split(u, kind, H)]
        A, B = blocks[0].shape
        o = [newton_schulz(b) for b in blocks]
        p = p * (1 - 1e-2 * 0.1) - 1e-2 * 0.2 * math.sqrt(max(A, B)) * _join(o, kind, shape)
        torch.testing.assert_close(w.detach(), p, atol=1e-6, rtol=1e-5)


def _split(u, kind, H):
    if kind == "rows":
        return list(u.chunk(H, 0))
    if kind == "cols":
        return list(u.chunk(H, 1))
    return list(u) if kind == "experts" else [u]


def _join(o, kind, shape):
    if kind == "rows":
        return torch.cat(o, 0)
    if kind == "cols":
        return torch.cat(o, 1)
    return torch.stack(o) if kind == "experts" else o[0]
