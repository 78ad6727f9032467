"""k3's MoonViT in Kimi K2.5's configuration against transformers' ``Kimi_K25`` (random weights): the same image
features, image by image, for images of different sizes packed into one sequence; and the same logits for a prompt
with images when the language model is K2.5's too."""

import pytest
import torch
from safetensors.torch import load_file, save_file

from k3.pretrained import load_pretrained

transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "Kimi_K25ForConditionalGeneration"):
    pytest.skip("this transformers has no Kimi_K25 (models/kimi_k25)", allow_module_level=True)

DEEPSEEK = dict(vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=3,
                num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2,
                n_shared_experts=1, kv_lora_rank=32, q_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=16,
                v_head_dim=16, first_k_dense_replace=1, n_group=1, topk_group=1, pad_token_id=0, bos_token_id=1,
                eos_token_id=2, routed_scaling_factor=2.5, num_nextn_predict_layers=0, model_type="deepseek_v3")
# K2.5's tower at test size: LayerNorm, biases, bicubic position grid, head dim 16 (width 64, 4 heads)
VISION = dict(patch_size=14, pos_emb_height=8, pos_emb_width=8, num_attention_heads=4, num_hidden_layers=2,
              hidden_size=64, intermediate_size=96)
IMAGE_ID = 200
GRIDS = [(6, 10), (8, 8), (2, 4), (12, 6)]  # in patches: smaller, equal and larger than the 8 x 8 position grid


def _release_vision(hf_state: dict, heads: int) -> dict:
    """transformers' vision tower and projector -> the K2.5 release's names (what k3 reads), undoing transformers'
    permutation of the q/k rows (its RoPE rotates halves; the release's rotates interleaved pairs) and fusing q, k, v
    into wqkv."""
    def unpermute(t):  # transformers' PermuteForRope, inverted: per head (2, Dh/2) -> (Dh/2, 2)
        return t.reshape(heads, 2, t.shape[0] // heads // 2, *t.shape[1:]).transpose(1, 2).reshape(t.shape)

    out = {}
    for name, t in hf_state.items():
        if name.startswith("model.mm_projector."):
            out["mm_projector." + name[len("model.mm_projector."):].replace("in_proj", "proj.0")
                .replace("out_proj", "proj.2")] = t
        if not name.startswith("model.vision_tower."):
            continue
        rest = name[len("model.vision_tower."):]
        if rest == "patch_embed.pos_emb.position_embeddings":
            out["vision_tower.patch_embed.pos_emb.weight"] = t
        elif rest.startswith("patch_embed."):
            out["vision_tower." + rest] = t
        elif ".attn.q_proj." in rest:
            stem, kind = rest.split(".attn.")[0], rest.rsplit(".", 1)[1]
            q, k, v = (hf_state[f"model.vision_tower.{stem}.attn.{p}_proj.{kind}"] for p in "qkv")
            out[f"vision_tower.encoder.{stem.replace('layers', 'blocks')}.wqkv.{kind}"] = torch.cat(
                [unpermute(q), unpermute(k), v])
        elif ".attn.k_proj." not in rest and ".attn.v_proj." not in rest:
            rest = (rest.replace("layers.", "blocks.").replace("norm1", "norm0").replace("norm2", "norm1")
                    .replace("mlp.fc1", "mlp.fc0").replace("mlp.fc2", "mlp.fc1").replace("attn.proj", "wo"))
            out["vision_tower.encoder." + rest] = t
    return out


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """transformers' K2.5 with random weights, and k3's model loaded from a directory in the K2.5 release's layout
    holding the same weights (the text model as transformers' DeepseekV3ForCausalLM writes it)."""
    d = tmp_path_factory.mktemp("k25")
    torch.manual_seed(0)
    cfg = transformers.Kimi_K25Config(text_config=DEEPSEEK, vision_config=VISION, projection_hidden_size=64,
                                      image_token_id=IMAGE_ID, tie_word_embeddings=False)
    hf = transformers.Kimi_K25ForConditionalGeneration(cfg).eval()
    with torch.no_grad():  # biases and norms start at 0 / 1: give them values that would show a mix-up
        for name, p in hf.named_parameters():
            if "vision_tower" in name or "mm_projector" in name:
                p.normal_(0, 0.05 if p.dim() > 1 else 0.3).add_(1.0 if "norm" in name and name.endswith("weight") else 0)
        for name, b in hf.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0, 0.1)
    text = transformers.DeepseekV3ForCausalLM(cfg.text_config)
    text.model.load_state_dict(hf.model.language_model.state_dict())
    text.lm_head.load_state_dict(hf.lm_head.state_dict())
    text.save_pretrained(d / "text")
    tensors = {f"language_model.{k}": v for k, v in load_file(d / "text" / "model.safetensors").items()}
    tensors |= _release_vision(hf.state_dict(), VISION["num_attention_heads"])
    save_file({k: v.contiguous() for k, v in tensors.items()}, d / "model.safetensors")
    (d / "config.json").write_text(cfg.to_json_string(use_diff=True))  # transformers' K2.5 config.json
    return hf, load_pretrained(d, vision=True).eval()


def _images(seed=1):
    g = torch.Generator().manual_seed(seed)
    pixels = torch.randn(sum(h * w for h, w in GRIDS), 3, 14, 14, generator=g)
    return pixels, torch.tensor([[1, h, w] for h, w in GRIDS])


def test_k25_configuration_is_read_from_transformers_config(pair):
    _, model = pair
    v = model.vision_config
    assert (v.vt_hidden_size, v.vt_num_attention_heads, v.head_dim, v.norm_type, v.mm_projector_type,
            v.pos_emb_interpolation_mode, v.attn_bias, v.linear_bias) == (64, 4, 16, "layernorm", "patchmerger",
                                                                         "bicubic", True, True)
    assert model.media_placeholder_token_id == IMAGE_ID


def test_image_features_equal_transformers_k25(pair):
    hf, model = pair
    pixels, grid_thw = _images()
    with torch.no_grad():
        ref = hf.model.get_image_features(pixels, grid_thw).pooler_output  # one [h*w/4, D] per image
        ours = model.encode_images(pixels, [(h, w) for _, h, w in grid_thw.tolist()])
    assert [r.shape[0] for r in ref] == [h * w // 4 for h, w in GRIDS]
    torch.testing.assert_close(ours, torch.cat(ref), rtol=1e-5, atol=1e-5)
    # each image alone gives its own features: nothing leaks between the images of one packed sequence
    start, offset = 0, 0
    for (h, w), r in zip(GRIDS, ref):
        with torch.no_grad():
            alone = model.encode_images(pixels[start: start + h * w], [(h, w)])
        torch.testing.assert_close(alone, r, rtol=1e-5, atol=1e-5)
        start, offset = start + h * w, offset + r.shape[0]


def test_logits_with_images_equal_transformers_k25(pair):
    hf, model = pair
    pixels, grid_thw = _images(2)
    n = [h * w // 4 for h, w in GRIDS]
    ids = [5, 6] + [IMAGE_ID] * n[0] + [7] + [IMAGE_ID] * n[1] + [8, 9] + [IMAGE_ID] * n[2] + [10] + \
        [IMAGE_ID] * n[3] + [11, 12, 13]
    x = torch.tensor([ids])
    with torch.no_grad():
        ref = hf(input_ids=x, pixel_values=pixels, image_grid_thw=grid_thw).logits
        ours = model(x, pixels, [(h, w) for _, h, w in grid_thw.tolist()]).logits
    torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-4)
