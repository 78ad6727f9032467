"""Export in the release's compressed-tensors layout (``mxfp4-pack-quantized``): per routed expert
``w{1,2,3}.weight_packed`` uint8 [out, in/2] (element 2i in the low nibble) and ``weight_scale`` uint8 [out, in/32],
``quantization_config`` in config.json; loading gives bit-identical dequantised weights; and a packed file written
here by hand, independently of the exporter, loads to the values the format defines."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from k3 import K3Config, K3ForCausalLM
from k3.checkpoint import to_hf_state_dict
from k3.pretrained import load_pretrained, save_pretrained
from k3.ops.mx import dequantize_mxfp4, quantize_mxfp4
from k3.quant import PackedExpertBank

CFG = K3Config.preset("tiny").replace(moe_intermediate_size=64, vocab_size=300)
E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]  # OCP MX table 6
RELEASE_QC = {  # the release's quantization_config, as published
    "config_groups": {"group_0": {"format": "mxfp4-pack-quantized", "input_activations": None,
                                  "output_activations": None, "targets": ["Linear"],
                                  "weights": {"num_bits": 4, "group_size": 32, "type": "float", "strategy": "group",
                                              "symmetric": True, "scale_dtype": "torch.uint8", "observer": "minmax",
                                              "dynamic": False}}},
    "format": "mxfp4-pack-quantized", "quant_method": "compressed-tensors", "quantization_status": "compressed",
    "ignore": ["re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|gate_up|down)_proj.*",
               "re:.*lm_head.*", "re:.*vision_tower.*", "re:.*mm_projector.*"]}


def _experts(model):
    return {n: p.detach() for n, p in model.state_dict().items() if ".experts.w" in n}


def test_export_round_trip_is_bit_identical(tmp_path):
    torch.manual_seed(0)
    model = K3ForCausalLM(CFG)
    save_pretrained(model, tmp_path, quantization="mxfp4")
    files = load_file(tmp_path / "model.safetensors")
    name = "model.layers.1.block_sparse_moe.experts.3.w2"
    L, I = CFG.expert_dim, CFG.moe_intermediate_size
    assert files[f"{name}.weight_packed"].dtype == torch.uint8 and files[f"{name}.weight_packed"].shape == (L, I // 2)
    assert files[f"{name}.weight_scale"].dtype == torch.uint8 and files[f"{name}.weight_scale"].shape == (L, I // 32)
    assert not [k for k in files if ".experts." in k and k.endswith(".weight")]
    assert "mtp.0" not in str(list(files)) and f"model.layers.{CFG.num_hidden_layers}.block_sparse_moe.experts.0.w1" \
        ".weight_packed" in files  # the MTP layer's experts, at the release's layer index
    qc = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    assert qc["format"] == "mxfp4-pack-quantized" and qc["quant_method"] == "compressed-tensors"
    assert qc["quantization_status"] == "compressed"
    w = qc["config_groups"]["group_0"]["weights"]
    assert (w["num_bits"], w["group_size"], w["type"], w["strategy"], w["scale_dtype"]) == \
        (4, 32, "float", "group", "torch.uint8")

    for dtype in (torch.float32, torch.bfloat16):
        loaded = load_pretrained(tmp_path, dtype=dtype)
        for n, t in _experts(loaded).items():
            ref = _experts(model)[n]
            assert torch.equal(t, dequantize_mxfp4(*quantize_mxfp4(ref), dtype)), n
    loaded = load_pretrained(tmp_path, dtype=torch.float32)
    for n, t in model.state_dict().items():  # everything else is written as it was
        if ".experts.w" not in n:
            assert torch.equal(loaded.state_dict()[n], t), n

    packed = load_pretrained(tmp_path, dtype=torch.float32, keep_packed=True)
    bank = packed.model.layers[1].block_sparse_moe.experts
    assert isinstance(bank, PackedExpertBank)
    assert torch.equal(bank.w2.weight_packed[3], files[f"{name}.weight_packed"])
    save_pretrained(packed, tmp_path / "again", max_shard_bytes=40_000)  # a packed model stays packed; sharded
    again = load_pretrained(tmp_path / "again", dtype=torch.float32)
    assert (tmp_path / "again" / "model.safetensors.index.json").exists()
    assert all(torch.equal(t, _experts(loaded)[n]) for n, t in _experts(again).items())
    assert json.loads((tmp_path / "again" / "config.json").read_text())["quantization_config"] == qc


def test_a_hand_written_release_file_loads_to_the_values_the_format_defines(tmp_path):
    """The release's layout written without k3's exporter: random 4-bit codes and E8M0 bytes, packed two per byte
    by hand (element 2i in the low nibble), the release's ``language_model.`` prefix and quantization_config."""
    torch.manual_seed(0)
    model = K3ForCausalLM(CFG.replace(tie_word_embeddings=False))
    hf = {f"language_model.{k}": v for k, v in to_hf_state_dict(model.state_dict(), model.config).items()
          if ".experts." not in k}
    g = torch.Generator().manual_seed(1)
    expect, raw = {}, {}
    for layer in range(1, CFG.num_hidden_layers + CFG.num_nextn_predict_layers):
        for e in range(CFG.num_experts):
            for w, (out_f, in_f) in (("w1", (64, 32)), ("w3", (64, 32)), ("w2", (32, 64))):
                codes = torch.randint(0, 16, (out_f, in_f), generator=g).tolist()
                scales = torch.randint(100, 140, (out_f, in_f // 32), generator=g).tolist()
                packed = [[codes[r][2 * i] | (codes[r][2 * i + 1] << 4) for i in range(in_f // 2)]
                          for r in range(out_f)]
                name = f"model.layers.{layer}.block_sparse_moe.experts.{e}.{w}"
                hf[f"language_model.{name}.weight_packed"] = torch.tensor(packed, dtype=torch.uint8)
                hf[f"language_model.{name}.weight_scale"] = torch.tensor(scales, dtype=torch.uint8)
                raw[name] = hf[f"language_model.{name}.weight_packed"]
                expect[name] = torch.tensor([[E2M1[codes[r][c]] * 2.0 ** (scales[r][c // 32] - 127)
                                              for c in range(in_f)] for r in range(out_f)])
    save_file(hf, tmp_path / "model.safetensors")
    text = model.config.to_hf()["text_config"]  # the K3 release's text config, nested as the release nests it
    text["quantization_config"] = RELEASE_QC
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["KimiK3ForConditionalGeneration"],
                                                      "text_config": text}))

    loaded = load_pretrained(tmp_path, dtype=torch.float32)
    packed = load_pretrained(tmp_path, dtype=torch.float32, keep_packed=True)
    for layer in range(1, CFG.num_hidden_layers):
        bank = loaded.model.layers[layer].block_sparse_moe.experts
        pbank = packed.model.layers[layer].block_sparse_moe.experts
        for w in ("w1", "w3", "w2"):
            for e in range(CFG.num_experts):
                name = f"model.layers.{layer}.block_sparse_moe.experts.{e}.{w}"
                assert torch.equal(getattr(bank, w)[e], expect[name]), name
                assert torch.equal(getattr(pbank, w).weight_packed[e], raw[name]), name
    mtp = loaded.mtp[0].block.block_sparse_moe.experts.w1[2]
    assert torch.equal(mtp, expect[f"model.layers.{CFG.num_hidden_layers}.block_sparse_moe.experts.2.w1"])


def test_a_dequantised_release_saved_plain_drops_the_quantization_config(tmp_path):
    torch.manual_seed(0)
    save_pretrained(K3ForCausalLM(CFG), tmp_path / "packed", quantization="mxfp4")
    loaded = load_pretrained(tmp_path / "packed", dtype=torch.float32)
    assert "quantization_config" not in loaded.config.extra  # dequantised in memory: the config says what it holds
    save_pretrained(loaded, tmp_path / "plain")
    assert "quantization_config" not in json.loads((tmp_path / "plain" / "config.json").read_text())
    assert any(k.endswith("experts.0.w1.weight") for k in load_file(tmp_path / "plain" / "model.safetensors"))
    with pytest.raises(ValueError, match="quantization"):
        save_pretrained(loaded, tmp_path / "x", quantization="int4")
