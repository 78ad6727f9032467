"""``k3 params`` with a vision tower: the tower and projector rows are the modules' own parameter counts (read from a
multimodal config.json or named with --vision), outside the text total and active; and the ~341M vs 401M question:
SPEC's numbers (attention width = model width, no position grid) give ~341M, the release's ``qkv_hidden_size`` 1536
and 64 x 64 position grid account exactly for the rest."""

import json

import torch

from k3 import K3Config
from k3.cli import main
from k3.pretrained import save_pretrained
from k3.vision import K3ForConditionalGeneration, VisionConfig
from k3.vision.model import count_vision_parameters


def test_params_counts_the_vision_rows_of_a_multimodal_config(tmp_path, capsys):
    cfg = K3Config.preset("tiny")
    model = K3ForConditionalGeneration(cfg, VisionConfig.preset("tiny"), media_placeholder_token_id=3)
    save_pretrained(model, tmp_path)
    assert main(["params", "--config", str(tmp_path), "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    tower = sum(p.numel() for p in model.vision_tower.parameters())
    projector = sum(p.numel() for p in model.mm_projector.parameters())
    assert r["vision"] == {"vision_tower": tower, "mm_projector": projector}
    assert r["total"] == sum(p.numel() for p in model.language_model.parameters())  # the text model alone
    assert r["total_with_vision"] == r["total"] + tower + projector
    assert main(["params", "--config", str(tmp_path)]) == 0
    table = capsys.readouterr().out
    assert f"vision_tower{tower:>24,}" in table and "TOTAL + vision" in table
    assert main(["params", "--preset", "tiny", "--json"]) == 0
    assert "vision" not in json.loads(capsys.readouterr().out)  # a text-only config has no vision rows


def test_the_release_tower_and_what_explains_341m_vs_401m(capsys):
    assert main(["params", "--preset", "kimi-k3", "--vision", "moonvit-v2", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["vision"] == {"vision_tower": 401_214_464, "mm_projector": 46_144_512}
    v2 = VisionConfig.preset("moonvit-v2")
    # SPEC's numbers alone: the attention as wide as the model (1024; 8 heads here, as 1024 does not split into 12)
    spec_only = v2.replace(qkv_hidden_size=None, vt_num_attention_heads=8, init_pos_emb_height=1, init_pos_emb_width=1)
    n_spec = count_vision_parameters(spec_only, 7168)["vision_tower"] - 1024  # less the 1 x 1 grid left in
    assert round(n_spec / 1e6) == 340  # ~341M with K2.5's biases (340.7M), 340.4M without
    qkv = 27 * (3 + 1) * (1536 - 1024) * 1024  # wqkv's three outputs and wo's input at 1536 instead of 1024
    grid = 64 * 64 * 1024  # the learned position grid
    assert n_spec + qkv + grid == 401_214_464
    with torch.device("meta"):
        assert sum(p.numel() for p in K3ForConditionalGeneration(
            K3Config.preset("tiny"), v2, 3).vision_tower.parameters()) == 401_214_464
