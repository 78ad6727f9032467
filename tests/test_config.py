import json

import pytest

from k3 import PRESETS, K3Config

OFFICIAL = {  # the published layout (SPEC §1 field names and values)
    "architectures": ["KimiK3ForConditionalGeneration"],
    "model_type": "kimi_k3",
    "media_placeholder_token_id": 163605,
    "vision_config": {"vt_num_hidden_layers": 27, "vt_hidden_size": 1024, "patch_size": 14},
    "text_config": {
        "model_type": "kimi_linear", "architectures": ["KimiLinearForCausalLM"],
        "vocab_size": 163840, "hidden_size": 7168, "num_hidden_layers": 93, "num_attention_heads": 96,
        "num_key_value_heads": 96, "intermediate_size": 33792, "rms_norm_eps": 1e-5,
        "max_position_embeddings": 1048576, "tie_word_embeddings": False, "hidden_act": "situ",
        "activation_situ_beta": 4.0, "activation_situ_linear_beta": 25.0, "attn_res_block_size": 12,
        "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
        "v_head_dim": 128, "mla_use_nope": True, "mla_use_output_gate": True,
        "num_experts": 896, "num_experts_per_token": 16, "num_shared_experts": 2, "moe_intermediate_size": 3072,
        "routed_expert_hidden_size": 3584, "latent_moe_use_norm": True, "moe_router_activation_func": "sigmoid",
        "moe_renormalize": True, "routed_scaling_factor": 1.0, "use_grouped_topk": True, "num_expert_group": 1,
        "topk_group": 1, "topk_method": "noaux_tc", "first_k_dense_replace": 1, "moe_layer_freq": 1,
        "num_nextn_predict_layers": 0, "torch_dtype": "bfloat16",
        "linear_attn_config": {
            "num_heads": 96, "head_dim": 128, "short_conv_kernel_size": 4, "gate_lower_bound": -5.0,
            "use_full_rank_gate": True,
            "full_attn_layers": [i for i in range(1, 94) if i % 4 == 0 or i == 93],
            "kda_layers": [i for i in range(1, 94) if not (i % 4 == 0 or i == 93)],
        },
    },
}


def test_official_layout_loads_as_the_kimi_k3_preset(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(OFFICIAL))
    c = K3Config.from_hf(tmp_path)
    ref = K3Config.preset("kimi-k3")
    for f in ("hidden_size", "num_hidden_layers", "full_attn_layers", "kda_layers", "gate", "gate_lower_bound",
              "num_experts", "routed_expert_hidden_size", "attn_res", "attn_res_block_size", "hidden_act"):
        assert getattr(c, f) == getattr(ref, f), f
    assert len(c.kda_layers) == 69 and len(c.full_attn_layers) == 24
    assert [i for i in range(93) if c.layer_kind(i) == "mla"][:3] == [3, 7, 11]


def test_round_trip_is_lossless(tmp_path):
    c = K3Config.from_hf(OFFICIAL)
    out = c.to_hf()
    assert out["text_config"] == OFFICIAL["text_config"] | {k: v for k, v in out["text_config"].items()
                                                          if k not in OFFICIAL["text_config"]}
    for k, v in OFFICIAL.items():  # every published key comes back with its value
        if k != "text_config":
            assert out[k] == v
    assert K3Config.from_hf(out) == c
    c.save(tmp_path / "config.json")
    assert K3Config.from_hf(tmp_path / "config.json") == c


@pytest.mark.parametrize("name", list(PRESETS))
def test_presets_round_trip(name):
    c = K3Config.preset(name)
    assert K3Config.from_hf(json.loads(json.dumps(c.to_hf()))) == c


@pytest.mark.parametrize("variant", [{"attn_res": "full"}, {"attn_res": "none"}, {"gate": "softplus"},
                                     {"activation": "swiglu"}, {"latent_moe": False}, {"latent_moe_norm": False},
                                     {"layers": "all-mla"}, {"layers": "all-kda"}])
def test_variants_round_trip(variant):
    c = K3Config.preset("tiny").variant(**variant)
    assert K3Config.from_hf(json.loads(json.dumps(c.to_hf()))) == c


def _broken(**changes):
    d = json.loads(json.dumps(OFFICIAL["text_config"]))
    lin = changes.pop("linear", {})
    d["linear_attn_config"].update(lin)
    d.update(changes)
    return d


@pytest.mark.parametrize("changes,field", [
    ({"linear": {"kda_layers": list(range(1, 94))}}, "both MLA and KDA"),
    ({"num_experts_per_token": 1000}, "num_experts_per_token"),
    ({"linear": {"kda_layers": [1, 2]}}, "neither KDA nor MLA"),
    ({"linear": {"full_attn_layers": [0, 4]}}, "1-based"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"num_expert_group": 8}, "num_expert_group"),
    ({"some_new_field": 1}, "some_new_field"),
    ({"linear": {"gate_lower_bound": 2.0}}, "gate_lower_bound"),
])
def test_inconsistent_or_unknown_fields_name_the_field(changes, field):
    with pytest.raises(ValueError, match=field):
        K3Config.from_hf(_broken(**changes))


def test_unknown_fields_can_be_carried_when_not_strict():
    c = K3Config.from_hf(_broken(some_new_field=1), strict=False)
    assert c.to_hf()["text_config"]["some_new_field"] == 1


def test_bare_text_config_and_kimi_linear_style():
    c = K3Config.from_hf(OFFICIAL["text_config"])
    assert c == K3Config.from_hf(OFFICIAL).replace(top_level=None)
    lin = K3Config.preset("kimi-linear-48b").to_hf()
    assert "gate_lower_bound" not in lin["linear_attn_config"] and "attn_res_block_size" not in lin
    assert K3Config.from_hf(lin).gate == "softplus"


# ---- the layouts each reader expects ------------------------------------------------------------------------

def test_k3_models_are_written_in_the_release_layout():
    """A config.json written from a preset has what AutoConfig / mlx-lm need to pick the architecture."""
    out = K3Config.preset("tiny").replace(eos_token_id=0).to_hf()
    assert out["model_type"] == "kimi_k3" and out["architectures"] == ["KimiK3ForConditionalGeneration"]
    assert out["eos_token_id"] == 0 and "bos_token_id" in out and "pad_token_id" in out
    text = out["text_config"]
    assert text["model_type"] == "kimi_linear" and text["num_key_value_heads"] == text["num_attention_heads"]
    assert text["eos_token_id"] == 0 and text["linear_attn_config"]["gate_lower_bound"] == -5.0


def test_kimi_linear_models_are_written_as_transformers_writes_them():
    out = K3Config.preset("kimi-linear-48b").to_hf()
    assert out["model_type"] == "kimi_linear" and out["architectures"] == ["KimiLinearForCausalLM"]
    assert "text_config" not in out
    for key in ("num_key_value_heads", "model_max_length", "head_dim", "rope_theta", "layer_types", "mlp_layer_types",
                "bos_token_id", "eos_token_id", "pad_token_id", "first_k_dense_replace"):
        assert key in out, key
    assert out["layer_types"][3] == "full_attention" and out["mlp_layer_types"][:2] == ["dense", "sparse"]


# What transformers 5.x's KimiLinearForCausalLM.save_pretrained writes for a small model (keys and values as it
# writes them; no first_k_dense_replace, no K3 key).
TRANSFORMERS_KIMI_LINEAR = {
    "architectures": ["KimiLinearForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 1, "dtype": "float32", "eos_token_id": 2, "head_dim": 8, "hidden_act": "silu",
    "hidden_size": 64, "initializer_range": 0.02, "intermediate_size": 128, "kv_lora_rank": 32,
    "layer_types": ["linear_attention", "linear_attention", "linear_attention", "full_attention"],
    "linear_attn_config": {"full_attn_layers": [4], "head_dim": 16, "kda_layers": [1, 2, 3], "num_heads": 4,
                           "short_conv_kernel_size": 4},
    "linear_conv_kernel_dim": 4, "linear_head_dim": 16, "linear_num_heads": 4,
    "mlp_layer_types": ["dense", "sparse", "sparse", "sparse"], "model_max_length": 1048576,
    "model_type": "kimi_linear", "moe_intermediate_size": 32, "moe_renormalize": True, "num_attention_heads": 4,
    "num_expert_group": 1, "num_experts": 8, "num_experts_per_token": 2, "num_hidden_layers": 4,
    "num_key_value_heads": 4, "num_shared_experts": 1, "output_router_logits": False, "pad_token_id": 0,
    "pretraining_tp": 1, "q_lora_rank": None, "qk_head_dim": 24, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8,
    "rms_norm_eps": 1e-05, "routed_scaling_factor": 2.446, "tie_word_embeddings": False, "topk_group": 1,
    "transformers_version": "5.24.0", "use_cache": True, "v_head_dim": 16, "vocab_size": 256,
}


def test_reads_what_transformers_writes_as_kimi_linear():
    """Missing keys mean Kimi Linear (no output gate, no latent MoE, softplus gate), never K3's defaults."""
    c = K3Config.from_hf(TRANSFORMERS_KIMI_LINEAR)
    assert c.hf_layout == "kimi_linear"
    assert (c.mla_use_output_gate, c.latent_moe, c.gate, c.use_full_rank_gate, c.attn_res) == \
        (False, False, "softplus", False, "none")
    assert (c.full_attn_layers, c.kda_layers, c.first_k_dense_replace) == ((4,), (1, 2, 3), 1)
    assert (c.bos_token_id, c.eos_token_id, c.pad_token_id, c.max_position_embeddings) == (1, 2, 0, 1048576)
    out = c.to_hf()
    for k, v in TRANSFORMERS_KIMI_LINEAR.items():  # everything comes back
        assert (v.items() <= out[k].items()) if isinstance(v, dict) else out[k] == v, k
    assert K3Config.from_hf(out) == c


def test_transformers_flat_keys_and_aliases():
    d = {k: v for k, v in TRANSFORMERS_KIMI_LINEAR.items() if k != "linear_attn_config"}
    d["num_local_experts"] = d.pop("num_experts")  # the names KimiLinearConfig(...) accepts as keyword arguments
    d["num_experts_per_tok"] = d.pop("num_experts_per_token")
    c = K3Config.from_hf(d)
    assert c == K3Config.from_hf(TRANSFORMERS_KIMI_LINEAR)
    bare = {k: v for k, v in TRANSFORMERS_KIMI_LINEAR.items() if k not in ("linear_attn_config", "layer_types")}
    # neither linear_attn_config nor layer_types: KimiLinearConfig's own pattern (0-based i > 0, i % 4 == 0)
    assert K3Config.from_hf(bare).full_attn_layers == ()
    nine = {**bare, "num_hidden_layers": 9, "mlp_layer_types": ["dense"] + ["sparse"] * 8}
    assert K3Config.from_hf(nine).full_attn_layers == (5, 9)


def test_kimi_linear_48b_release_config_keys():
    """The Kimi-Linear-48B config.json carries model_max_length (and no K3 key)."""
    d = {k: v for k, v in K3Config.preset("kimi-linear-48b").to_hf().items()
         if k not in ("layer_types", "mlp_layer_types", "qk_head_dim", "mla_use_output_gate",
                      "routed_expert_hidden_size", "latent_moe_use_norm", "activation_situ_beta",
                      "activation_situ_linear_beta", "num_nextn_predict_layers")}
    assert K3Config.from_hf(d) == K3Config.preset("kimi-linear-48b")


@pytest.mark.parametrize("changes,message", [
    ({"layer_types": ["full_attention"] * 4}, "layer_types does not agree"),
    ({"mlp_layer_types": ["sparse", "dense", "sparse", "sparse"]}, "dense' layers first"),
    ({"qk_head_dim": 30}, "qk_head_dim = 30"),
    ({"num_key_value_heads": 2}, "num_key_value_heads = 2"),
    ({"num_local_experts": 4}, "'num_local_experts' = 4 and 'num_experts' = 8"),
    ({"model_type": "llama"}, "model_type 'llama'"),
])
def test_inconsistent_transformers_keys_are_named(changes, message):
    with pytest.raises(ValueError, match=message):
        K3Config.from_hf({**TRANSFORMERS_KIMI_LINEAR, **changes})


def test_missing_file_and_bad_json(tmp_path):
    with pytest.raises(FileNotFoundError):
        K3Config.from_hf(tmp_path / "nope.json")
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        K3Config.from_hf(tmp_path)
    with pytest.raises(ValueError, match="unknown preset"):
        K3Config.preset("kimi-k4")


def test_an_unknown_field_names_the_file_and_a_way_the_cli_offers(tmp_path, monkeypatch, capsys):
    from k3.cli import main

    (tmp_path / "config.json").write_text(json.dumps(_broken(some_new_field=1)))
    assert main(["params", "--config", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert f"{tmp_path / 'config.json'}: unknown field 'some_new_field' in the text config" in err
    assert "Remove it from the file" in err and "K3_CONFIG_UNKNOWN=keep" in err
    monkeypatch.setenv("K3_CONFIG_UNKNOWN", "keep")  # the way the message offers, for any command
    assert main(["params", "--config", str(tmp_path)]) == 0
    assert K3Config.from_hf(tmp_path).to_hf()["text_config"]["some_new_field"] == 1
    monkeypatch.setenv("K3_CONFIG_UNKNOWN", "yes")
    with pytest.raises(ValueError, match="K3_CONFIG_UNKNOWN='yes': the only value is 'keep'"):
        K3Config.from_hf(tmp_path)
