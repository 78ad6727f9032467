import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from k3 import K3Config, K3ForCausalLM
from k3.checkpoint import CheckpointError, read_checkpoint, write_checkpoint
from k3.checkpoint.io import read_hf_tensors
from k3.pretrained import load_pretrained, save_pretrained
from k3.quant import dequantize_mxfp4, quantize_mxfp4


@pytest.fixture
def model():
    torch.manual_seed(0)
    return K3ForCausalLM(K3Config.preset("tiny")).eval()


def logits(m, x):
    with torch.no_grad():
        return m(x)["logits"]


@pytest.mark.slow
@pytest.mark.parametrize("shard", [None, 300_000])
def test_save_load_round_trip(tmp_path, model, shard):
    kw = {"max_shard_bytes": shard} if shard else {}
    save_pretrained(model, tmp_path, **kw)
    files = {p.name for p in tmp_path.iterdir()}
    assert ("model.safetensors.index.json" in files) == bool(shard)
    assert not [f for f in files if f.endswith(".tmp")]
    x = torch.randint(0, 1024, (2, 16))
    torch.testing.assert_close(logits(load_pretrained(tmp_path), x), logits(model, x))


def test_checkpoint_io_is_state_dicts_only(tmp_path, model):
    """k3.checkpoint writes and reads a state dict in our names (no model built): the tensors come back equal,
    under the module tree's names, and a quantization_config is written only when one is given."""
    state = model.state_dict()
    write_checkpoint(tmp_path, state, model.config, max_shard_bytes=300_000)
    assert "quantization_config" not in json.loads((tmp_path / "config.json").read_text())
    back = read_checkpoint(tmp_path)
    assert back.vision is False and back.skipped == [] and back.config == model.config
    expected = {k: v for k, v in state.items() if not (model.config.tie_word_embeddings and k == "lm_head.weight")}
    assert sorted(back.state) == sorted(expected)
    for k, v in expected.items():
        assert torch.equal(back.state[k], v.to(back.state[k].dtype)), k
    write_checkpoint(tmp_path / "q", state, model.config, quantization_config={"format": "x"})
    assert json.loads((tmp_path / "q" / "config.json").read_text())["quantization_config"] == {"format": "x"}


def test_official_weight_names(tmp_path, model):
    save_pretrained(model, tmp_path)
    names = set(load_file(tmp_path / "model.safetensors"))
    L = model.config.num_hidden_layers
    for n in ["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight",
              "model.output_attn_res_proj.weight", "model.output_attn_res_norm.weight",
              "model.layers.0.self_attention_res_proj.weight", "model.layers.0.mlp_res_norm.weight",
              "model.layers.0.self_attn.q_conv1d.weight", "model.layers.0.self_attn.f_a_proj.weight",
              "model.layers.0.self_attn.A_log", "model.layers.0.self_attn.dt_bias", "model.layers.0.self_attn.o_norm.weight",
              "model.layers.0.mlp.gate_proj.weight", "model.layers.3.self_attn.kv_a_proj_with_mqa.weight",
              "model.layers.3.self_attn.q_a_layernorm.weight", "model.layers.3.self_attn.g_proj.weight",
              "model.layers.1.block_sparse_moe.gate.e_score_correction_bias",
              "model.layers.1.block_sparse_moe.routed_expert_down_proj.weight",
              "model.layers.1.block_sparse_moe.routed_expert_norm.weight",
              "model.layers.1.block_sparse_moe.experts.7.w2.weight",
              "model.layers.1.block_sparse_moe.shared_experts.up_proj.weight",
              f"model.layers.{L}.eh_proj.weight", f"model.layers.{L}.enorm.weight",
              f"model.layers.{L}.shared_head.norm.weight", f"model.layers.{L}.self_attn.kv_b_proj.weight"]:
        assert n in names, n
    assert not any(".experts.w1" in n or n.startswith("mtp.") for n in names)
    assert load_file(tmp_path / "model.safetensors")["model.layers.0.self_attention_res_proj.weight"].shape == (1, 64)


def test_loads_the_release_layout_prefix_mxfp4_aliases_and_padded_A_log(tmp_path, model):
    """Rewrite our checkpoint the way the multimodal release ships it, then load it."""
    save_pretrained(model, tmp_path)
    hf = load_file(tmp_path / "model.safetensors")
    rel, expect = {}, {}
    for n, t in hf.items():
        if ".experts." in n and n.endswith(".weight"):
            packed, scale = quantize_mxfp4(t)
            rel[f"language_model.{n[:-len('weight')]}weight_packed"] = packed
            rel[f"language_model.{n[:-len('weight')]}weight_scale"] = scale
            expect[n] = dequantize_mxfp4(packed, scale, torch.float32)
        elif n.endswith("self_attention_res_proj.weight") and "layers.2." in n:
            rel[f"language_model.{n.replace('_res_proj.weight', '_res.proj_weight')}"] = t[0]
        elif n.endswith("A_log"):
            rel[f"language_model.{n}"] = torch.cat([t, torch.zeros(4)])  # padded beyond the 4 heads
        else:
            rel[f"language_model.{n}"] = t
    rel["vision_tower.patch_embed.proj.weight"] = torch.zeros(2, 3)
    out = tmp_path / "release"
    out.mkdir()
    save_file(rel, out / "model.safetensors")
    cfg = model.config.replace(top_level={"model_type": "kimi_k3", "vision_config": {}})
    (out / "config.json").write_text(json.dumps(cfg.to_hf()))
    m2 = load_pretrained(out)
    assert m2.skipped_weights == ["vision_tower.patch_embed.proj.weight"]
    w1 = m2.model.layers[1].block_sparse_moe.experts.w1
    torch.testing.assert_close(w1[7], expect["model.layers.1.block_sparse_moe.experts.7.w1.weight"])
    torch.testing.assert_close(m2.model.layers[0].self_attn.A_log, model.model.layers[0].self_attn.A_log)


def test_mxfp4_round_trip_is_exact_on_representable_values():
    codes = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.5, -6.0] * 16)[:32]
    w = torch.stack([codes * 2.0**e for e in (-3, 0, 5)])
    p, s = quantize_mxfp4(w)
    assert p.shape == (3, 16) and s.shape == (3, 1)
    torch.testing.assert_close(dequantize_mxfp4(p, s, torch.float32), w)


def test_wrong_config_is_named(tmp_path, model):
    save_pretrained(model, tmp_path)
    other = model.config.replace(hidden_size=96)
    with pytest.raises(CheckpointError, match="shape mismatch"):
        load_pretrained(tmp_path, config=other)
    with pytest.raises(CheckpointError, match="missing"):
        load_pretrained(tmp_path, config=model.config.replace(num_nextn_predict_layers=2))


def test_truncated_file_is_named(tmp_path, model):
    save_pretrained(model, tmp_path)
    f = tmp_path / "model.safetensors"
    f.write_bytes(f.read_bytes()[:1000])
    with pytest.raises(CheckpointError, match="truncated or corrupt"):
        read_hf_tensors(tmp_path)
    with pytest.raises(CheckpointError, match="not a checkpoint directory"):
        read_hf_tensors(tmp_path / "nothing")


def test_failed_write_leaves_the_old_checkpoint_intact(tmp_path, model, monkeypatch):
    save_pretrained(model, tmp_path)
    before = (tmp_path / "model.safetensors").read_bytes()
    import k3.checkpoint.io as io

    def boom(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(io, "save_file", boom)
    with pytest.raises(OSError):
        save_pretrained(model, tmp_path)
    assert (tmp_path / "model.safetensors").read_bytes() == before
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]
