"""MoonViT-V2's pieces against independent statements (SPEC §10): attention within each image of a packed
sequence, packed images equal images alone (outputs and gradients), 2-D RoPE as complex rotation, the 2 x 2 merge,
the position grid; K3ForConditionalGeneration's splice and loss; the V2 parameter count."""

import pytest
import torch
import torch.nn.functional as F

from k3 import K3Config
from k3.vision import K3ForConditionalGeneration, MoonViT, VisionConfig
from k3.vision.attention import attend_images, attend_images_reference
from k3.vision.tower import apply_rope, grid_cu_seqlens, merge_patches, rope_2d

TINY = VisionConfig.preset("tiny")


def _rel(a, b):
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("lengths", [[7], [5, 16, 16, 3, 40], [1, 2]])
def test_attention_stays_within_each_image(lengths):
    g = torch.Generator().manual_seed(0)
    T = sum(lengths)
    q, k, v = (torch.randn(T, 3, 8, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3))
    cu = torch.tensor([0, *lengths]).cumsum(0)
    out = attend_images_reference(q, k, v, cu)
    ref = torch.cat([F.scaled_dot_product_attention(*(x[a:b].transpose(0, 1) for x in (q, k, v))).transpose(0, 1)
                     for a, b in zip(cu[:-1].tolist(), cu[1:].tolist())])
    torch.testing.assert_close(out, ref)
    w = torch.randn_like(out)
    grads = torch.autograd.grad((out * w).sum(), (q, k, v))
    ref_grads = torch.autograd.grad((ref * w).sum(), (q, k, v))
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b)
    for max_scores in (1 << 25, 3 * 40, 1):  # one call per group; chunks of a row or more; one query row a call
        fast = attend_images(q, k, v, cu, max_scores=max_scores)
        torch.testing.assert_close(fast, out)
        for a, b in zip(torch.autograd.grad((fast * w).sum(), (q, k, v)), grads):
            torch.testing.assert_close(a, b)


def test_tower_attention_holds_no_image_sized_scores(monkeypatch):
    """Off CUDA every SDPA call gets 4-D inputs (CPU's flash kernel; a 3-D call takes the math path, L x L) and at
    most max_scores scores, for one image and for a padded group."""
    calls = []
    real = F.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None):
        calls.append((q.dim(), q.shape[0] * q.shape[1] * q.shape[2] * k.shape[2]))
        return real(q, k, v, attn_mask=attn_mask)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    for lengths in ([300], [300, 280, 9]):
        q, k, v = (torch.randn(sum(lengths), 2, 8) for _ in range(3))
        calls.clear()
        attend_images(q, k, v, torch.tensor([0, *lengths]).cumsum(0), max_scores=2 * 300 * 64)
        assert calls and all(dim == 4 and scores <= 2 * 300 * 64 for dim, scores in calls), calls
        assert len(calls) > 1  # the large image's queries came in chunks


def test_rope_is_a_complex_rotation_by_column_and_row():
    grids = [(3, 5), (2, 2)]
    Dh, theta = 16, 10000.0
    cos, sin = rope_2d(grids, Dh, theta)
    x = torch.randn(19, 2, Dh)
    got = apply_rope(x, cos, sin)
    inv = theta ** (-torch.arange(0, Dh, 4).float() / Dh)  # [Dh/4]
    rows = [(y, c) for h, w in grids for y in range(h) for c in range(w)]
    for t, (y, c) in enumerate(rows):
        angle = torch.stack([c * inv, y * inv], dim=-1).flatten()  # pair 2i: column, pair 2i+1: row
        z = torch.view_as_complex(x[t].reshape(2, Dh // 2, 2)) * torch.polar(torch.ones(Dh // 2), angle)
        torch.testing.assert_close(got[t], torch.view_as_real(z).reshape(2, Dh))


def test_merge_takes_each_2x2_neighbourhood_row_major():
    grids = [(2, 4), (4, 2)]
    x = torch.arange(16.0)[:, None]
    m = merge_patches(x, grids, (2, 2))[..., 0]
    assert m.tolist() == [[0, 1, 4, 5], [2, 3, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]]
    with pytest.raises(ValueError, match="does not divide into 2 x 2"):
        merge_patches(torch.zeros(6, 1), [(3, 2)], (2, 2))


def test_position_grid_native_size_and_resampling():
    tower = MoonViT(TINY)
    with torch.no_grad():
        tower.patch_embed.pos_emb.weight.normal_()
    w = tower.patch_embed.pos_emb.weight
    torch.testing.assert_close(tower.patch_embed.pos_emb([(8, 8)]), w.flatten(0, 1))
    with torch.no_grad():
        w.copy_(torch.linspace(0, 1, 64).view(8, 8, 1).expand(8, 8, 64))
    up = tower.patch_embed.pos_emb([(16, 4)])  # bilinear, align_corners=False: stays within the grid's range
    assert up.min() >= 0 and up.max() <= 1 and up.shape == (64, 64)


def test_packed_images_equal_images_alone_outputs_and_gradients():
    torch.manual_seed(0)
    model = K3ForConditionalGeneration(K3Config.preset("tiny"), TINY, media_placeholder_token_id=3)
    grids = [(4, 6), (2, 2), (10, 8), (8, 8)]
    pixels = torch.randn(sum(h * w for h, w in grids), 3, 14, 14, requires_grad=True)
    packed = model.encode_images(pixels, grids)
    alone, start = [], 0
    for h, w in grids:
        alone.append(model.encode_images(pixels[start: start + h * w], [(h, w)]))
        start += h * w
    torch.testing.assert_close(packed, torch.cat(alone), rtol=1e-5, atol=1e-6)
    wgt = torch.randn_like(packed)
    g_packed = torch.autograd.grad((packed * wgt).sum(), [pixels, model.vision_tower.encoder.blocks[0].wqkv.weight])
    g_alone = torch.autograd.grad((torch.cat(alone) * wgt).sum(),
                                  [pixels, model.vision_tower.encoder.blocks[0].wqkv.weight])
    for a, b in zip(g_packed, g_alone):
        assert _rel(a, b) < 1e-5
    assert grid_cu_seqlens(grids).tolist() == [0, 24, 28, 108, 172]


def test_splice_replaces_placeholders_and_loss_ignores_them():
    torch.manual_seed(0)
    model = K3ForConditionalGeneration(K3Config.preset("tiny").replace(num_nextn_predict_layers=0), TINY,
                                       media_placeholder_token_id=3)
    grids = [(2, 4), (2, 2)]
    pixels = torch.randn(12, 3, 14, 14)
    ids = torch.tensor([[7, 3, 3, 8, 9, 3, 10]])
    x = model.embed(ids, pixels, grids)
    feats = model.encode_images(pixels, grids)
    torch.testing.assert_close(x[0, [1, 2, 5]], feats)
    torch.testing.assert_close(x[0, [0, 3, 4, 6]], model.language_model.model.embed_tokens(ids)[0, [0, 3, 4, 6]])
    out = model(ids, pixels, grids, labels=ids)
    logits = out.logits[0, :-1]
    tgt = ids[0, 1:].clone()
    tgt[tgt == 3] = -100  # a placeholder is never a target
    torch.testing.assert_close(out.loss, F.cross_entropy(logits, tgt, ignore_index=-100))
    out.loss.backward()
    assert model.vision_tower.patch_embed.proj.weight.grad.abs().sum() > 0  # the loss reaches the tower
    with pytest.raises(ValueError, match="3 image placeholder tokens .* give 4 tokens"):
        model.embed(ids, torch.randn(16, 3, 14, 14), [(4, 4)])


def test_moonvit_v2_parameter_count():
    cfg = VisionConfig.preset("moonvit-v2")
    with torch.device("meta"):
        tower = MoonViT(cfg)
    n = sum(p.numel() for p in tower.parameters())
    layer = 1024 * 3 * 1536 + 1536 * 1024 + 2 * 1024 * 4096 + 2 * 1024  # wqkv, wo, fc0 + fc1, two RMSNorms
    assert n == 27 * layer + 3 * 14 * 14 * 1024 + 64 * 64 * 1024 + 1024 == 401_214_464
