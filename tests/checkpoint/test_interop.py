"""Checkpoints that move between k3, transformers (KimiLinearForCausalLM) and mlx-lm, in both directions."""

import json
import warnings

import pytest
import torch
from safetensors.torch import load_file, save_file

from k3 import K3Config, K3ForCausalLM
from k3.checkpoint import CheckpointError
from k3.pretrained import load_pretrained, save_pretrained
from tests.test_config import TRANSFORMERS_KIMI_LINEAR

KIMI_LINEAR = K3Config.from_hf(TRANSFORMERS_KIMI_LINEAR)  # 4 layers (3 KDA, 1 MLA), dense + plain MoE, softplus gate


def _logits(model, x):
    with torch.no_grad():
        return model(x).logits


def _rel(a, b):
    return float((a - b).norm() / b.norm())


def _greedy(model, x, n):
    for _ in range(n):
        x = torch.cat([x, _logits(model, x)[:, -1].argmax(-1, keepdim=True)], dim=1)
    return x


@pytest.fixture
def transformers():
    return pytest.importorskip("transformers")


@pytest.mark.slow
def test_from_pretrained_reads_a_directory_transformers_wrote(tmp_path, transformers):
    torch.manual_seed(0)
    hf_cfg = transformers.KimiLinearConfig(**{k: v for k, v in TRANSFORMERS_KIMI_LINEAR.items()
                                              if k not in ("architectures", "transformers_version", "dtype")})
    hf = transformers.KimiLinearForCausalLM(hf_cfg).eval()
    with torch.no_grad():  # A_log and the router bias start at values that would hide a mix-up
        for name, p in hf.named_parameters():
            if name.endswith("A_log"):
                p.uniform_(-1.0, 1.0)
        for name, b in hf.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0, 0.1)
    hf.save_pretrained(tmp_path)
    names = set(load_file(tmp_path / "model.safetensors"))
    assert "model.layers.0.block_sparse_moe.gate_proj.weight" in names  # transformers' name for layer 0's dense MLP
    model = load_pretrained(tmp_path).eval()
    assert model.config.hf_layout == "kimi_linear" and not model.config.mla_use_output_gate
    x = torch.randint(0, 256, (2, 12))
    assert _rel(_logits(model, x), _logits(hf, x)) < 1e-5
    ref = hf.generate(x[:1], max_new_tokens=4, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert torch.equal(_greedy(model, x[:1], 4), ref)


@pytest.mark.slow
def test_transformers_loads_what_k3_writes(tmp_path, transformers):
    torch.manual_seed(0)
    model = K3ForCausalLM(KIMI_LINEAR).eval()
    save_pretrained(model, tmp_path)
    t = load_file(tmp_path / "model.safetensors")
    assert t["model.layers.0.self_attn.A_log"].shape == (1, 1, 4, 1)  # the shape transformers' module holds
    config = transformers.AutoConfig.from_pretrained(tmp_path)
    assert type(config).__name__ == "KimiLinearConfig" and config.layer_types[3] == "full_attention"
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    x = torch.randint(0, 256, (2, 12))
    assert _rel(_logits(hf, x), _logits(model, x)) < 1e-5
    back = load_pretrained(tmp_path)  # and k3 reads its own file back
    torch.testing.assert_close(_logits(back, x), _logits(model, x))


# ---- mlx-lm ---------------------------------------------------------------------------------------------------
# mlx-lm runs on Apple silicon only; these checks state what its loader requires, read from its source
# (ml-explore/mlx-lm: utils.py load_model/_get_classes, models/kimi_linear.py ModelArgs + sanitize,
# models/kimi_k3.py TextArgs/ModelArgs + sanitize): the module is chosen by config["model_type"], ModelArgs
# fields without a default must be present, sanitize() reshapes dt_bias / A_log only where stated below, and
# load_weights(strict=True) then compares every shape with the module's.
MLX_KIMI_LINEAR_REQUIRED = ("model_type", "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                            "num_key_value_heads", "intermediate_size", "head_dim", "rope_theta", "rms_norm_eps",
                            "linear_attn_config", "model_max_length", "num_experts", "moe_intermediate_size",
                            "kv_lora_rank")


def mlx_reader_problems(directory) -> list[str]:
    cfg = json.loads((directory / "config.json").read_text())
    w = load_file(directory / "model.safetensors")
    if "model_type" not in cfg:
        return ["config.json has no model_type (mlx_lm.utils._get_classes: KeyError)"]
    problems = []
    if cfg["model_type"] == "kimi_linear":
        text = cfg
        problems += [f"missing {k}" for k in MLX_KIMI_LINEAR_REQUIRED if k not in cfg]
    elif cfg["model_type"] == "kimi_k3":
        text = cfg.get("text_config", cfg)
        if text.get("hidden_act") != "situ" or text.get("moe_router_activation_func", "sigmoid") != "sigmoid":
            problems.append("kimi_k3 reads SiTU with a sigmoid router only")
        if not text.get("mla_use_nope", True):
            problems.append("kimi_k3 reads NoPE MLA only")
    else:
        return [f"model_type {cfg['model_type']!r} is not an mlx-lm Kimi module"]
    lin = text.get("linear_attn_config", {})
    problems += [f"linear_attn_config lacks {k}" for k in ("kda_layers", "num_heads", "head_dim",
                                                             "short_conv_kernel_size") if k not in lin]
    if problems:
        return problems
    H, K = lin["num_heads"], lin["head_dim"]
    for layer in lin["kda_layers"]:
        p = f"model.layers.{layer - 1}.self_attn."
        a_log = w[p + "A_log"].shape
        if cfg["model_type"] == "kimi_linear" and a_log != (1, 1, H, 1):  # not reshaped by kimi_linear.sanitize
            problems.append(f"{p}A_log is {tuple(a_log)}, the module holds (1, 1, {H}, 1)")
        if w[p + "dt_bias"].numel() != H * K or w[p + "q_conv1d.weight"].dim() != 3:
            problems.append(f"{p}dt_bias / q_conv1d have the wrong size")
    for i in range(text["num_hidden_layers"]):
        if (i + 1) in lin["kda_layers"]:
            continue
        has_q = f"model.layers.{i}.self_attn.q_proj.weight" in w
        if cfg["model_type"] == "kimi_linear" and not has_q:
            problems.append(f"layer {i}: mlx-lm's Kimi Linear MLA has a plain q_proj only")
        if i >= text.get("first_k_dense_replace", 0) and text.get("num_experts"):
            if f"model.layers.{i}.block_sparse_moe.gate.e_score_correction_bias" not in w:
                problems.append(f"layer {i}: router bias not at block_sparse_moe.gate.e_score_correction_bias")
    if cfg.get("eos_token_id") is None and not (directory / "generation_config.json").exists():
        problems.append("no eos_token_id for mlx_lm.utils.load_config")
    return problems


@pytest.mark.parametrize("name", ["kimi_linear", "kimi_k3"])
def test_what_k3_writes_has_what_mlx_lm_reads(tmp_path, name):
    cfg = KIMI_LINEAR if name == "kimi_linear" else K3Config.preset("tiny").replace(eos_token_id=0)
    save_pretrained(K3ForCausalLM(cfg), tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == name
    assert mlx_reader_problems(tmp_path) == []


def test_the_mlx_check_catches_what_main_wrote(tmp_path):
    """The check is not vacuous: the layout k3 wrote before (no model_type, A_log [H]) fails it."""
    save_pretrained(K3ForCausalLM(KIMI_LINEAR), tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({k: v for k, v in KIMI_LINEAR.to_hf().items()
                                                      if k != "model_type"}))
    assert "no model_type" in mlx_reader_problems(tmp_path)[0]
    t = load_file(tmp_path / "model.safetensors")
    t["model.layers.0.self_attn.A_log"] = t["model.layers.0.self_attn.A_log"].reshape(-1)
    save_file(t, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text(json.dumps(KIMI_LINEAR.to_hf()))
    assert any("A_log" in p for p in mlx_reader_problems(tmp_path))


# ---- aliases of the K3 release and of other readers -------------------------------------------------------------

@pytest.mark.slow
def test_every_documented_alias_loads(tmp_path):
    torch.manual_seed(0)
    model = K3ForCausalLM(K3Config.preset("tiny").replace(eos_token_id=0)).eval()
    with torch.no_grad():
        for m in model.modules():
            if hasattr(m, "e_score_correction_bias"):
                m.e_score_correction_bias.normal_(0, 0.1)
    save_pretrained(model, tmp_path)
    t = load_file(tmp_path / "model.safetensors")
    H, K, L = 4, 16, model.config.num_hidden_layers
    out = {}
    for n, v in t.items():
        if n.endswith("A_log"):
            out[n] = torch.cat([v, torch.full((3,), 0.7)]).reshape(1, 1, H + 3, 1)  # padded, NOT with zeros
        elif n.endswith("dt_bias"):
            out[n] = v.reshape(H, K)
        elif n.endswith("block_sparse_moe.gate.e_score_correction_bias"):
            out[n.replace(".gate.e_score_correction_bias", ".e_score_correction_bias")] = v
        elif n.startswith(f"model.layers.{L}."):
            out[n.replace(f"model.layers.{L}.", "model.mtp.layers.0.")] = v
        elif n.startswith("model.layers.0.mlp."):
            out[n.replace(".mlp.", ".block_sparse_moe.")] = v  # transformers' re-save of the dense layer
        else:
            out[n] = v
    out["vision_model.encoder.weight"] = torch.zeros(2)
    out["vision_tower.patch_embed.weight"] = torch.zeros(2)
    save_file(out, tmp_path / "model.safetensors")
    (tmp_path / "SHA256SUMS").unlink(missing_ok=True)  # rewritten by hand: as another tool writes it
    with pytest.warns(UserWarning, match=r"skipped 2 tensor\(s\) .*vision_model, vision_tower"):
        loaded = load_pretrained(tmp_path)
    x = torch.randint(0, 1024, (1, 16))
    with torch.no_grad():
        a, b = loaded(x, labels=x), model(x, labels=x)
    torch.testing.assert_close(a.logits, b.logits)
    torch.testing.assert_close(a.mtp_loss, b.mtp_loss)  # the MTP layer came from model.mtp.*


def test_wrong_shapes_and_missing_mechanisms_say_what_was_expected(tmp_path):
    save_pretrained(K3ForCausalLM(K3Config.preset("tiny")), tmp_path)
    t = load_file(tmp_path / "model.safetensors")
    bad = dict(t, **{"model.layers.0.self_attn.dt_bias": torch.zeros(5, 3)})
    save_file(bad, tmp_path / "model.safetensors")
    (tmp_path / "SHA256SUMS").unlink(missing_ok=True)  # rewritten by hand: as another tool writes it
    with pytest.raises(CheckpointError, match=r"dt_bias has shape \(5, 3\); expected 64 values"):
        load_pretrained(tmp_path)
    save_file({n: v for n, v in t.items() if not n.endswith("self_attn.g_proj.weight")}, tmp_path / "model.safetensors")
    (tmp_path / "SHA256SUMS").unlink(missing_ok=True)  # rewritten by hand: as another tool writes it
    with pytest.raises(CheckpointError, match="MLA output gate on"):
        load_pretrained(tmp_path)


def test_dequantised_release_is_not_saved_as_quantised(tmp_path):
    cfg = K3Config.preset("tiny")
    save_pretrained(K3ForCausalLM(cfg), tmp_path)
    d = cfg.to_hf()
    d["text_config"]["quantization_config"] = {"quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized"}
    (tmp_path / "config.json").write_text(json.dumps(d))
    (tmp_path / "SHA256SUMS").unlink(missing_ok=True)  # rewritten by hand: as another tool writes it
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model = load_pretrained(tmp_path)
    assert "quantization_config" not in model.config.extra
    save_pretrained(model, tmp_path / "again")
    assert "quantization_config" not in json.loads((tmp_path / "again" / "config.json").read_text())["text_config"]


@pytest.mark.slow
def test_output_has_attribute_and_dict_access():
    model = K3ForCausalLM(K3Config.preset("tiny")).eval()
    x = torch.randint(0, 1024, (1, 8))
    out = model(x, labels=x)
    assert out.loss is out["loss"] and out.logits is out["logits"] and out.mtp_loss is out["mtp_loss"]
    assert model(x).loss is None and "loss" not in model(x)
    with pytest.raises(AttributeError, match="no field 'logit'"):
        out.logit
    leaves, spec = torch.utils._pytree.tree_flatten(out)  # FSDP2 finds the tensors inside
    assert len(leaves) == 4 and torch.utils._pytree.tree_unflatten(leaves, spec).lm_loss is out.lm_loss


# ---- Kimi K2 / K2.5: the DeepSeek-V3 architecture ----------------------------------------------------------------
DEEPSEEK = dict(vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=3,
                num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2,
                n_shared_experts=1, kv_lora_rank=32, q_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=16,
                v_head_dim=16, first_k_dense_replace=1, n_group=1, topk_group=1, pad_token_id=0, bos_token_id=1,
                eos_token_id=2, routed_scaling_factor=2.5)


def test_kimi_k2_architecture_both_ways_with_deepseek_v3(tmp_path, transformers):
    torch.manual_seed(0)
    hf = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**DEEPSEEK)).eval()
    with torch.no_grad():
        for name, b in hf.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0, 0.1)
    hf.save_pretrained(tmp_path / "hf")
    with pytest.warns(UserWarning, match="no MTP weights"):  # DeepseekV3Config declares one; transformers has none
        model = load_pretrained(tmp_path / "hf").eval()
    assert model.config.hf_layout == "deepseek_v3" and not model.config.mla_use_nope
    x = torch.randint(0, 256, (2, 12))
    assert _rel(_logits(model, x), _logits(hf, x)) < 1e-5
    save_pretrained(model, tmp_path / "k3")
    assert "model.layers.1.mlp.experts.3.up_proj.weight" in load_file(tmp_path / "k3" / "model.safetensors")
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "k3").eval()
    assert type(back).__name__ == "DeepseekV3ForCausalLM" and _rel(_logits(back, x), _logits(model, x)) < 1e-5


# Kimi K2's own YaRN settings (beta_fast = beta_slow = 1, mscale = mscale_all_dim = 1), then DeepSeek-V3's (32 / 1,
# mscale_all_dim only), at a pretraining length of 8 so that 40 positions reach far into the extension
K2_YARN = {"type": "yarn", "factor": 32.0, "original_max_position_embeddings": 8, "beta_fast": 1.0, "beta_slow": 1.0,
           "mscale": 1.0, "mscale_all_dim": 1.0}
DSV3_YARN = {"type": "yarn", "factor": 40.0, "original_max_position_embeddings": 8, "beta_fast": 32, "beta_slow": 1,
             "mscale": 1.0, "mscale_all_dim": 0.707}


@pytest.mark.parametrize("yarn", [K2_YARN, DSV3_YARN], ids=["k2", "deepseek_v3"])
def test_yarn_rope_matches_transformers_deepseek_v3_both_ways(tmp_path, transformers, yarn):
    """Kimi K2's YaRN-extended RoPE: the same logits as transformers' DeepseekV3 with the same rope_scaling, past the
    original context too; saved back, transformers reads the same model. Without YaRN the logits differ."""
    torch.manual_seed(0)
    hf = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(
        **DEEPSEEK, rope_scaling=dict(yarn), max_position_embeddings=256)).eval()  # a copy: transformers edits it
    hf.save_pretrained(tmp_path / "hf")
    with pytest.warns(UserWarning, match="no MTP weights"):
        model = load_pretrained(tmp_path / "hf").eval()
    assert model.config.rope_scaling["factor"] == yarn["factor"]
    x = torch.randint(0, 256, (2, 40))
    assert _rel(_logits(model, x), _logits(hf, x)) < 1e-5
    plain = K3ForCausalLM(model.config.replace(rope_scaling=None)).eval()
    plain.load_state_dict(model.state_dict())
    assert _rel(_logits(plain, x), _logits(hf, x)) > 1e-3  # the extension is what makes them equal
    save_pretrained(model, tmp_path / "k3")
    assert json.loads((tmp_path / "k3" / "config.json").read_text())["rope_scaling"]["factor"] == yarn["factor"]
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "k3").eval()
    assert _rel(_logits(back, x), _logits(model, x)) < 1e-5


def test_bad_rope_scaling_is_named():
    base = {"model_type": "deepseek_v3", **DEEPSEEK}
    with pytest.raises(ValueError, match="rope_scaling: YaRN needs a positive 'factor'"):
        K3Config.from_hf({**base, "rope_scaling": {"type": "yarn", "original_max_position_embeddings": 8}})
    with pytest.raises(ValueError, match=r"rope_scaling: unknown YaRN key\(s\) \['low_freq_factor'\]"):
        K3Config.from_hf({**base, "rope_scaling": {**K2_YARN, "low_freq_factor": 1.0}})
    with pytest.raises(ValueError, match="rope_scaling: applies to MLA with RoPE"):
        K3Config.preset("tiny").replace(rope_scaling=K2_YARN)


def test_reads_the_kimi_k2_5_release_layout(tmp_path):
    """K2.5 wraps the K2 language model (text_config "kimi_k2") beside a vision tower: k3 loads the text model."""
    cfg = K3Config.from_hf({"model_type": "deepseek_v3", **DEEPSEEK, "num_nextn_predict_layers": 0})
    torch.manual_seed(0)
    model = K3ForCausalLM(cfg).eval()
    save_pretrained(model, tmp_path)
    t = {f"language_model.{n}": v for n, v in load_file(tmp_path / "model.safetensors").items()}
    t.update({"vision_tower.encoder.blocks.0.wqkv.weight": torch.zeros(3, 2), "mm_projector.proj.0.weight": torch.zeros(2)})
    save_file(t, tmp_path / "model.safetensors")
    (tmp_path / "SHA256SUMS").unlink(missing_ok=True)  # rewritten by hand: as another tool writes it
    text = {**cfg.to_hf(), "model_type": "kimi_k2"}
    release = {"model_type": "kimi_k25", "architectures": ["KimiK25ForConditionalGeneration"], "text_config": text,
               "vision_config": {"patch_size": 14}, "media_placeholder_token_id": 163605}
    (tmp_path / "config.json").write_text(json.dumps(release))
    (tmp_path / "SHA256SUMS").unlink(missing_ok=True)  # rewritten by hand: as another tool writes it
    with pytest.warns(UserWarning, match="skipped 2 .*mm_projector, vision_tower"):
        loaded = load_pretrained(tmp_path)
    x = torch.randint(0, 256, (1, 10))
    torch.testing.assert_close(_logits(loaded, x), _logits(model, x))
    assert loaded.config.to_hf()["vision_config"] == {"patch_size": 14}  # the wrapper's keys are carried
    linear = {**text, "rope_scaling": {"type": "linear", "factor": 4.0}}
    with pytest.raises(ValueError, match="rope_scaling: rope type 'linear' is not implemented"):
        K3Config.from_hf({**release, "text_config": linear})
