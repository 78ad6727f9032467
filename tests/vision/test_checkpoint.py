"""The release's multimodal checkpoint layout (SPEC §1, §10): ``language_model.`` beside ``vision_tower.`` and
``mm_projector.``, written and read by K3ForConditionalGeneration; the text model alone still loads from it."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from k3 import K3Config, K3ForCausalLM
from k3.checkpoint import CheckpointError
from k3.pretrained import load_pretrained, save_pretrained
from k3.vision import K3ForConditionalGeneration, VisionConfig

GRIDS = [(4, 6), (2, 2)]


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    m = K3ForConditionalGeneration(K3Config.preset("tiny").replace(num_nextn_predict_layers=0),
                                   VisionConfig.preset("tiny"), media_placeholder_token_id=3).eval()
    with torch.no_grad():
        for p in m.vision_tower.parameters():
            p.add_(torch.randn_like(p) * 0.1)  # the norms away from 1: a mix-up would show
    return m


def _inputs():
    g = torch.Generator().manual_seed(1)
    ids = torch.tensor([[5, 6] + [3] * 6 + [7] + [3] + [8, 9]])
    return ids, torch.randn(28, 3, 14, 14, generator=g)


def _logits(m, ids, pixels):
    with torch.no_grad():
        return m(ids, pixels, GRIDS).logits


def test_round_trip_in_the_release_layout(tmp_path, model):
    save_pretrained(model, tmp_path)
    names = set(load_file(tmp_path / "model.safetensors"))
    for name in ("language_model.model.embed_tokens.weight", "language_model.lm_head.weight",
                 "language_model.model.layers.1.block_sparse_moe.experts.0.w1.weight",
                 "vision_tower.patch_embed.proj.weight", "vision_tower.patch_embed.pos_emb.weight",
                 "vision_tower.encoder.blocks.1.wqkv.weight", "vision_tower.encoder.final_layernorm.weight",
                 "mm_projector.proj.0.weight", "mm_projector.proj.2.weight", "mm_projector.post_norm.weight"):
        assert name in names, name
    assert all(n.startswith(("language_model.", "vision_tower.", "mm_projector.")) for n in names)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["model_type"] == "kimi_k3" and cfg["architectures"] == ["KimiK3ForConditionalGeneration"]
    assert cfg["media_placeholder_token_id"] == 3
    assert cfg["vision_config"]["qkv_hidden_size"] == 64 and cfg["vision_config"]["norm_type"] == "rmsnorm"
    back = load_pretrained(tmp_path, vision=True).eval()
    assert back.vision_config == model.vision_config
    ids, pixels = _inputs()
    torch.testing.assert_close(_logits(back, ids, pixels), _logits(model, ids, pixels), rtol=0, atol=0)


def test_the_loader_builds_the_class_the_config_describes(tmp_path, model):
    """``vision=None`` (what ``load_for_inference`` asks): a multimodal config.json gives K3ForConditionalGeneration,
    a text one K3ForCausalLM."""
    save_pretrained(model, tmp_path / "mm")
    save_pretrained(K3ForCausalLM(K3Config.preset("tiny")), tmp_path / "text")
    assert type(load_pretrained(tmp_path / "mm", vision=None)) is K3ForConditionalGeneration
    assert type(load_pretrained(tmp_path / "text", vision=None)) is K3ForCausalLM


def test_text_model_alone_loads_from_the_multimodal_checkpoint(tmp_path, model):
    save_pretrained(model, tmp_path)
    with pytest.warns(UserWarning, match="skipped 18 tensor\\(s\\) .*mm_projector, vision_tower"):
        text = load_pretrained(tmp_path)
    ids = torch.randint(10, 100, (1, 9))
    with torch.no_grad():
        torch.testing.assert_close(text(ids).logits, model.language_model(ids).logits, rtol=0, atol=0)


def test_projector_aliases_load(tmp_path, model):
    save_pretrained(model, tmp_path)
    t = load_file(tmp_path / "model.safetensors")
    renamed = {n.replace("mm_projector.", "multi_modal_projector.").replace("proj.0.", "linear_1.")
               .replace("proj.2.", "linear_2."): v for n, v in t.items()}
    save_file(renamed, tmp_path / "model.safetensors")
    back = load_pretrained(tmp_path, vision=True, verify=False).eval()
    ids, pixels = _inputs()
    torch.testing.assert_close(_logits(back, ids, pixels), _logits(model, ids, pixels), rtol=0, atol=0)


def test_vision_load_of_a_text_checkpoint_says_why(tmp_path):
    save_pretrained(K3ForCausalLM(K3Config.preset("tiny")), tmp_path)
    with pytest.raises(CheckpointError, match="no vision_config: a text-only checkpoint"):
        load_pretrained(tmp_path, vision=True)


def test_packed_experts_beside_the_vision_tower(tmp_path, model):
    save_pretrained(model, tmp_path, quantization="mxfp4")
    names = set(load_file(tmp_path / "model.safetensors"))
    assert "language_model.model.layers.1.block_sparse_moe.experts.0.w1.weight_packed" in names
    served = load_pretrained(tmp_path, vision=True, keep_packed=True).eval()
    ids, pixels = _inputs()
    assert _logits(served, ids, pixels).isfinite().all()
    assert type(served.language_model.model.layers[1].block_sparse_moe.experts).__name__ == "PackedExpertBank"
