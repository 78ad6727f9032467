import pytest

from k3 import K3Config
from k3.model.params import count_parameters


def test_kimi_k3_matches_the_report():
    r = count_parameters(K3Config.preset("kimi-k3"))
    assert r["total"] == pytest.approx(2779.5e9, rel=3e-3)
    assert r["active"] == pytest.approx(104.19e9, rel=3e-3)
    by = r["by_component"]
    assert by["mtp"]["total"] == 0 and by["embedding"]["active"] == 0
    assert by["routed_experts"]["active"] == round(by["routed_experts"]["total"] * 16 / 896)


def test_kimi_k2_matches_the_report():
    r = count_parameters(K3Config.preset("kimi-k2"))
    assert r["total"] == pytest.approx(1026e9, rel=1e-2)
    # K2's published 32.6B active counts the input embedding (DeepSeek-V3's convention)
    emb = r["by_component"]["embedding"]["total"]
    assert r["active"] + emb == pytest.approx(32.6e9, rel=1e-2)


def test_small_presets_sizes():
    assert count_parameters(K3Config.preset("tiny"))["total"] < 2_000_000
    assert 100e6 <= count_parameters(K3Config.preset("small"))["total"] <= 300e6


def test_every_component_of_k3_is_present():
    by = count_parameters(K3Config.preset("kimi-k3"))["by_component"]
    assert all(v["total"] > 0 for k, v in by.items() if k != "mtp")
    assert by["attn_res"]["total"] == (2 * 93 + 1) * 2 * 7168  # 187 pseudo-queries, each proj + key norm


def test_medium_preset_invariants():
    """``medium``: ~1B active for one-GPU runs, K3's structure at hidden 2048 (`k3 params --preset medium`)."""
    c = K3Config.preset("medium")
    assert (c.hidden_size, c.num_hidden_layers) == (2048, 24)
    assert c.full_attn_layers == (4, 8, 12, 16, 20, 24) and len(c.kda_layers) == 18  # 3:1, every 4th and the last
    assert (c.num_experts, c.num_experts_per_token, c.routed_expert_hidden_size) == (64, 8, c.hidden_size // 2)
    assert c.kda_head_dim == 128 and c.kda_num_heads * c.kda_head_dim == c.hidden_size  # fla's kernels need 128
    assert c.attn_res == "block" and c.attn_res_block_size == 6 and c.num_nextn_predict_layers == 1
    r = count_parameters(c)
    assert (r["total"], r["active"]) == (3_285_687_584, 1_060_596_768)  # the README's figures
    by = r["by_component"]
    assert by["routed_experts"]["active"] == round(by["routed_experts"]["total"] * 8 / 64)
    assert by["mtp"]["active"] == 0 and by["embedding"]["active"] == 0


def test_mtp_active_counts_each_mtp_layer_and_its_pass_through_the_head():
    """``mtp_active`` (training FLOPs of the MTP loss, not part of SPEC §1's active count): zero without MTP layers,
    per layer its own parameters (k of E routed experts) plus the LM head it applies again."""
    small = K3Config.preset("small")
    one, two = (count_parameters(small.replace(num_nextn_predict_layers=n)) for n in (1, 2))
    assert count_parameters(small.replace(num_nextn_predict_layers=0))["mtp_active"] == 0
    assert two["mtp_active"] == 2 * one["mtp_active"] and two["active"] == one["active"]
    layer = one["by_component"]["mtp"]["total"]  # one MTP layer, all experts
    experts = one["by_component"]["routed_experts"]["total"] // (small.num_hidden_layers - small.first_k_dense_replace)
    k, E = small.num_experts_per_token, small.num_experts
    head = small.vocab_size * small.hidden_size
    assert one["mtp_active"] == head + layer - experts + round(experts * k / E)
