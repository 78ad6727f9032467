"""VisionConfig reads the K3 release's vision_config and Kimi K2.5's (the release's and transformers'), writes the
K3 release's keys, and refuses what k3 does not build, naming the field."""

import pytest

from k3.vision import VisionConfig

# the K3 release's vision_config (as public readers of it spell it)
K3_RELEASE = {"patch_size": 14, "init_pos_emb_height": 64, "init_pos_emb_width": 64, "init_pos_emb_time": 4,
              "pos_emb_type": "divided_fixed", "vt_num_attention_heads": 12, "vt_num_hidden_layers": 27,
              "vt_hidden_size": 1024, "vt_intermediate_size": 4096, "merge_kernel_size": [2, 2],
              "merge_type": "sd2_tpool", "mm_projector_type": "patchmergerv2", "mm_hidden_size": 1024,
              "projector_hidden_act": "gelu", "projector_ln_eps": 1e-5, "qkv_hidden_size": 1536,
              "norm_type": "rmsnorm", "attn_bias": False, "patch_embed_proj_bias": False, "mlp_type": "mlp2",
              "linear_bias": False, "activation_func": "gelu_pytorch_tanh", "pos_emb_interpolation_mode": "bilinear",
              "text_hidden_size": 7168}
# K2.5's release: the tower's keys in vision_config, the projector's in the wrapper
K25_RELEASE = {"vision_config": {"patch_size": 14, "init_pos_emb_height": 64, "init_pos_emb_width": 64,
                                 "init_pos_emb_time": 4, "pos_emb_type": "divided_fixed", "num_attention_heads": 16,
                                 "num_hidden_layers": 27, "hidden_size": 1152, "intermediate_size": 4304,
                                 "merge_kernel_size": [2, 2], "video_attn_type": "spatial_temporal",
                                 "merge_type": "sd2_tpool"},
               "model_type": "kimi_k25", "mm_projector_type": "patchmerger", "projector_hidden_act": "gelu",
               "projector_ln_eps": 1e-5, "media_placeholder_token_id": 163605}


def test_reads_the_k3_release():
    v = VisionConfig.from_hf(K3_RELEASE)
    assert v == VisionConfig.preset("moonvit-v2").replace(text_hidden_size=7168, extra={"mm_hidden_size": 1024})
    assert (v.attention_width, v.head_dim, v.unit, v.merge) == (1536, 128, 28, 4)
    assert VisionConfig.from_hf(v.to_hf()) == v
    assert v.to_hf() == K3_RELEASE  # the same keys, the same values


def test_reads_the_k25_release():
    v = VisionConfig.from_hf(K25_RELEASE["vision_config"], K25_RELEASE)
    assert v == VisionConfig.preset("k25-moonvit").replace(extra={"video_attn_type": "spatial_temporal"})
    assert v.head_dim == 72 and v.norm_type == "layernorm" and v.mm_projector_type == "patchmerger"
    assert VisionConfig.from_hf(v.to_hf()) == v


@pytest.mark.parametrize("change, match", [
    ({"mm_projector_type": "mlp"}, "vision_config.mm_projector_type: must be one of"),
    ({"merge_type": "sd2"}, "vision_config.merge_type: k3 builds 'sd2_tpool' only"),
    ({"qkv_hidden_size": 1000}, "vision_config.qkv_hidden_size: the attention width 1000 must split into"),
    ({"vt_hidden_size": 0}, "vision_config.vt_hidden_size: must be a positive int"),
    ({"norm_type": "batchnorm"}, "vision_config.norm_type"),
])
def test_refuses_what_k3_does_not_build(change, match):
    with pytest.raises(ValueError, match=match):
        VisionConfig.from_hf({**K3_RELEASE, **change})
