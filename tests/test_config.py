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
    assert c.to_hf()["some_new_field"] == 1


def test_bare_text_config_and_kimi_linear_style():
    c = K3Config.from_hf(OFFICIAL["text_config"])
    assert c.top_level is None and "text_config" not in c.to_hf()
    lin = K3Config.preset("kimi-linear-48b").to_hf()
    assert "gate_lower_bound" not in lin["linear_attn_config"] and "attn_res_block_size" not in lin
    assert K3Config.from_hf(lin).gate == "softplus"


def test_missing_file_and_bad_json(tmp_path):
    with pytest.raises(FileNotFoundError):
        K3Config.from_hf(tmp_path / "nope.json")
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        K3Config.from_hf(tmp_path)
    with pytest.raises(ValueError, match="unknown preset"):
        K3Config.preset("kimi-k4")
