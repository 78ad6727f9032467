"""The depth stream against independent, naive statements of SPEC §3."""

import torch
from torch import nn

from k3.layers.depth.attn_res import DepthStream, PseudoQuery
from k3.ops.attn_res import attn_res_mix

D = 16


def make_queries(n):
    qs = [PseudoQuery(D, 1e-5) for _ in range(n)]
    with torch.no_grad():
        for q in qs:
            q.proj.weight.normal_()
            q.norm.weight.uniform_(0.5, 1.5)
    return qs


def sublayers(n):
    torch.manual_seed(1)
    return [nn.Sequential(nn.Linear(D, D), nn.Tanh()) for _ in range(n)]


def run_stream(emb, fs, qs, out_q, mode, block):
    s = DepthStream(emb, mode, block, 1e-5)
    for f, q in zip(fs, qs):
        s.write(f(s.read(q)))
    return s.output(out_q)


def mix(srcs, q):
    return attn_res_mix(torch.stack(srcs), q.proj.weight[0], q.norm.weight, 1e-5)


def test_block_size_one_is_full_attn_res():
    """Full AttnRes: sub-layer l reads softmax-mix of [embedding, every earlier sub-layer output]."""
    emb, fs, qs = torch.randn(2, 5, D), sublayers(6), make_queries(7)
    vals = [emb]
    for f, q in zip(fs, qs):
        vals.append(f(mix(vals, q)))
    ref = mix(vals, qs[6])
    got = run_stream(emb, fs, qs[:6], qs[6], "full", DepthStream.sublayer_block_size("full", 12))
    torch.testing.assert_close(got, ref)


def test_block_form_matches_spec_statement():
    """Block AttnRes, blocks of `bs` decoder layers (2*bs sub-layers): sub-layer l in block n mixes
    [b_0 = embedding, b_1..b_{n-1}, partial sum of block n so far (if any)]."""
    bs, n_layers = 2, 5
    emb, fs, qs = torch.randn(3, D), sublayers(2 * n_layers), make_queries(2 * n_layers + 1)
    blocks, partial = [emb], None
    for j, (f, q) in enumerate(zip(fs, qs)):
        srcs = blocks + ([partial] if partial is not None else [])
        out = f(mix(srcs, q) if len(srcs) > 1 else srcs[0])
        partial = out if partial is None else partial + out
        if (j + 1) % (2 * bs) == 0:
            blocks, partial = blocks + [partial], None
    ref = mix(blocks + ([partial] if partial is not None else []), qs[-1])
    got = run_stream(emb, fs, qs[:-1], qs[-1], "block", DepthStream.sublayer_block_size("block", bs))
    torch.testing.assert_close(got, ref)


def test_zero_pseudo_queries_mix_uniformly():
    emb = torch.randn(4, D)
    s = DepthStream(emb, "full", 1, 1e-5)
    q = PseudoQuery(D, 1e-5)  # zero-initialised
    outs = [emb]
    for _ in range(3):
        h = s.read(q)
        torch.testing.assert_close(h, torch.stack(outs).mean(0))
        o = torch.randn(4, D)
        s.write(o)
        outs.append(o)


def test_none_mode_is_a_plain_residual():
    emb = torch.randn(4, D)
    s = DepthStream(emb, "none", 1, 1e-5)
    a, b = torch.randn(4, D), torch.randn(4, D)
    s.read(None)
    s.write(a)
    torch.testing.assert_close(s.read(None), emb + a)
    s.write(b)
    torch.testing.assert_close(s.output(None), emb + a + b)
