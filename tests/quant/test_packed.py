"""Serving packed experts (SPEC §6-§7): PackedExpertBank is ExpertBank's drop-in with MXFP4 weights held packed
(4.25 bits per weight) and MXFP8 inputs, and computes what the QAT forward computes from the same weights.
Stated tolerance on CPU: none (bitwise equal) for the bank, the whole model's logits and greedy generation."""

import json

import pytest
import torch

from k3 import K3Config, K3ForCausalLM
from k3.pretrained import load_pretrained, save_pretrained
from k3.cli import main
from k3.data.tokenizer import save_tokenizer, train_tokenizer
from k3.layers.width.latent_moe import ExpertBank
from k3.model.params import count_bytes, memory_summary
from k3.ops.mx import quantize_mxfp4
from k3.quant import PackedExpertBank, pack_experts
from k3.quant import packed as packed_module

CFG = K3Config.preset("tiny").replace(qat="mxfp4", moe_intermediate_size=64, vocab_size=300)


def _routing(n, cfg, seed=0):
    g = torch.Generator().manual_seed(seed)
    idx = torch.stack([torch.randperm(cfg.num_experts, generator=g)[:cfg.num_experts_per_token] for _ in range(n)])
    return torch.rand(n, cfg.num_experts_per_token, generator=g), idx


def test_packed_bank_equals_the_qat_bank_and_holds_4_25_bits_per_weight():
    torch.manual_seed(0)
    bank = ExpertBank(CFG)
    packed = PackedExpertBank.from_bank(bank, CFG)
    z = torch.randn(40, CFG.expert_dim)
    w, idx = _routing(40, CFG)
    with torch.no_grad():
        assert torch.equal(packed(z, w, idx), bank(z, w, idx))
    for name in ("w1", "w3", "w2"):
        p, s = quantize_mxfp4(getattr(bank, name).detach())
        got = getattr(packed, name)
        assert torch.equal(got.weight_packed, p) and torch.equal(got.weight_scale, s)
    weights = sum(getattr(bank, n).numel() for n in ("w1", "w3", "w2"))
    held = sum(b.numel() * b.element_size() for b in packed.buffers())
    assert held * 8 / weights == 4.25 and not list(packed.parameters())


def test_the_reference_decodes_one_expert_at_a_time(monkeypatch):
    torch.manual_seed(0)
    packed = PackedExpertBank.from_bank(ExpertBank(CFG), CFG)
    shapes = []
    real = packed_module.dequantize_mxfp4
    monkeypatch.setattr(packed_module, "dequantize_mxfp4", lambda p, s, dtype: shapes.append(tuple(p.shape)) or
                        real(p, s, dtype))
    counts = torch.tensor([3, 0, 0, 5, 1, 0, 2, 0])
    M = int(counts.sum())
    packed.compute(torch.randn(M, CFG.expert_dim), counts, torch.rand(M, 1))
    per_call = {(CFG.moe_intermediate_size, CFG.expert_dim // 2), (CFG.expert_dim, CFG.moe_intermediate_size // 2)}
    assert set(shapes) == per_call and len(shapes) == 3 * 4  # 3 matrices of the 4 experts with rows, one by one


def test_packed_model_logits_and_generation_equal_the_qat_training_forward(tmp_path):
    torch.manual_seed(0)
    qat = K3ForCausalLM(CFG).eval()
    save_pretrained(qat, tmp_path, quantization="mxfp4")
    served = load_pretrained(tmp_path, dtype=torch.float32, keep_packed=True).eval()
    banks = [m for m in served.modules() if isinstance(m, PackedExpertBank)]
    assert len(banks) == CFG.num_hidden_layers - CFG.first_k_dense_replace + CFG.num_nextn_predict_layers
    ids = torch.randint(0, CFG.vocab_size, (2, 48))
    with torch.no_grad():
        assert torch.equal(served(ids)["logits"], qat(ids)["logits"])
    from k3.inference.api import SamplingParams
    from k3.inference.engine import Engine, EngineConfig

    tok = train_tokenizer(["hello world, this is k3.\n" * 5, "def f():\n    return 1\n" * 5], CFG.vocab_size)
    params = SamplingParams(max_tokens=8, temperature=0.0)
    prompt = [tok.encode("def f").ids]
    outs = [Engine(m, tok, EngineConfig(num_pages=8, page_tokens=64, hash_block=32)).generate(prompt, params)[0].text
            for m in (qat, served)]
    assert outs[0] == outs[1]


def test_keep_packed_quantises_a_float_checkpoint_on_load(tmp_path):
    torch.manual_seed(0)
    model = K3ForCausalLM(CFG.replace(qat=None))
    save_pretrained(model, tmp_path)
    assert "quantization_config" not in json.loads((tmp_path / "config.json").read_text())
    served = load_pretrained(tmp_path, dtype=torch.float32, keep_packed=True)
    bank, ref = served.model.layers[1].block_sparse_moe.experts, model.model.layers[1].block_sparse_moe.experts
    p, s = quantize_mxfp4(ref.w2.detach())
    assert torch.equal(bank.w2.weight_packed, p) and torch.equal(bank.w2.weight_scale, s)


def test_memory_by_component_with_packed_experts():
    torch.manual_seed(0)
    model = K3ForCausalLM(CFG)
    n = sum(p.numel() for name, p in model.named_parameters() if ".experts." in name and not name.startswith("mtp."))
    before = count_bytes(model)
    assert before["routed_experts"] == 4 * n  # fp32
    pack_experts(model)
    after = count_bytes(model)
    assert after["routed_experts"] * 8 == n * 4.25
    assert after["mtp"] < before["mtp"]  # the MTP layer's experts are packed too
    same = [k for k in after if k not in ("routed_experts", "mtp")]
    assert [after[k] for k in same] == [before[k] for k in same]
    line = memory_summary(model)
    assert "MXFP4 packed, 4.25 bits/weight" in line and f"model memory {sum(after.values()) / 2**20:.2f} MiB" in line


def test_params_reports_packed_bytes(capsys):
    assert main(["params", "--preset", "kimi-k3", "--packed-experts", "--json"]) == 0
    b = json.loads(capsys.readouterr().out)["bytes"]
    ratio = b["packed"]["routed_experts"] / b["bf16"]["routed_experts"]
    assert ratio == pytest.approx(4.25 / 16) and b["packed"]["kda"] == b["bf16"]["kda"]
    # bf16 everywhere but the packed experts: 1452.8 GiB; the release's 96 shards hold 1453.7 GiB
    assert sum(b["packed"].values()) / 2**30 == pytest.approx(1452.81, abs=0.01)
    assert main(["params", "--preset", "tiny", "--packed-experts"]) == 0
    assert "0.2656x their bf16 bytes" in capsys.readouterr().out


def test_generate_cli_with_packed_experts(tmp_path, capsys):
    tok = train_tokenizer(["hello world, this is k3.\n" * 5, "def f():\n    return 1\n" * 5], 300)
    torch.manual_seed(0)
    save_pretrained(K3ForCausalLM(CFG.replace(vocab_size=tok.get_vocab_size())), tmp_path)
    save_tokenizer(tok, tmp_path / "tokenizer.json")
    args = ["generate", "--checkpoint", str(tmp_path), "--prompt", "hello", "--max-tokens", "5", "--temperature", "0"]
    assert main(args + ["--packed-experts"]) == 0
    packed = capsys.readouterr().out
    assert main(args) == 0  # the QAT checkpoint unpacked: fake-quant experts, the same numbers
    assert capsys.readouterr().out == packed and packed.startswith("hello")
