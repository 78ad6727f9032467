"""End-to-end training on CPU: resume equality, checkpoint errors, metrics, the CLI around it."""

import dataclasses
import json
import os
import stat

import pytest
import torch

from k3.checkpoint import CheckpointError
from k3.cli import main
from k3.distributed.plan import ParallelDims, ParallelPlan
from k3.train.loop import TrainConfig, train
from k3.train.metrics import read_metrics

BASE = TrainConfig(out="", preset="tiny", data_max_bytes=400_000, tokenizer_bytes=200_000, vocab_size=512, steps=6,
                   batch_size=2, seq_len=64, lr=3e-3, eval_every=3, eval_batches=2, log_every=1, save_every=100)


def run(tmp_path, name, **kw):
    cfg = dataclasses.replace(BASE, out=str(tmp_path / name), **kw)
    return cfg, train(cfg, ParallelPlan(ParallelDims(), cfg.device), log=lambda *a: None)


def losses(out):
    return [(r["step"], r["loss"], r.get("val_loss"), r.get("load_max_over_mean")) for r in read_metrics(out)]


@pytest.mark.slow
def test_resume_reproduces_the_uninterrupted_loss_curve(tmp_path):
    straight, _ = run(tmp_path, "straight")
    cut, _ = run(tmp_path, "cut", stop_after=3)
    assert [r["step"] for r in read_metrics(cut.out)] == [1, 2, 3]
    run(tmp_path, "cut")  # the same command again: resumes at step 3
    a, b = losses(straight.out), losses(cut.out)
    assert [s for s, *_ in a] == list(range(1, 7))
    assert a == b  # bit-identical losses, validation losses and expert loads


@pytest.mark.slow
def test_metrics_checkpoint_and_entropy(tmp_path):
    umask = os.umask(0o022)
    try:
        cfg, result = run(tmp_path, "m", steps=4, eval_every=2)
    finally:
        os.umask(umask)
    recs = read_metrics(cfg.out)
    assert {"step", "loss", "lr", "tokens", "tokens_per_s", "grad_norm", "load_max_over_mean", "mtp_loss"} <= recs[0].keys()
    assert [r["step"] for r in recs if "val_loss" in r] == [2, 4]
    assert recs[-1]["tokens"] == 4 * 2 * 64
    assert recs[0]["lr"] < recs[1]["lr"] or recs[0]["lr"] == max(r["lr"] for r in recs)  # warm-up then decay
    ck = tmp_path / "m" / "checkpoint"
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "trainer_state.pt",
            "train_config.json", "SHA256SUMS"} == {p.name for p in ck.iterdir()}
    # the tokenizer's end of document is the model's eos_token_id: transformers' generate and mlx-lm stop there
    from k3.data.tokenizer import eos_id, load_tokenizer
    eos = eos_id(load_tokenizer(ck))
    assert json.loads((ck / "config.json").read_text())["eos_token_id"] == eos
    assert json.loads((ck / "generation_config.json").read_text())["eos_token_id"] == eos
    assert {oct(stat.S_IMODE(p.stat().st_mode)) for p in [*ck.iterdir(), *(tmp_path / "m").iterdir()]
            if p.is_file()} == {"0o644"}  # every output readable as usual, none 0600
    assert not [p for p in (tmp_path / "m").iterdir() if p.name.startswith(".checkpoint")]
    assert 3.0 < result["unigram_entropy"] < 7.0


def test_resume_refuses_another_config_and_a_truncated_checkpoint(tmp_path):
    run(tmp_path, "r", stop_after=2)
    with pytest.raises(ValueError, match="different"):
        run(tmp_path, "r", seq_len=32)
    ck = tmp_path / "r" / "checkpoint"
    state = ck / "trainer_state.pt"
    state.write_bytes(state.read_bytes()[:200])
    with pytest.raises(CheckpointError, match="trainer_state.pt"):
        run(tmp_path, "r")
    weights = ck / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:500])
    with pytest.raises(CheckpointError, match="truncated or corrupt"):
        run(tmp_path, "r")


@pytest.mark.slow
def test_checkpoint_of_another_model_config_is_named(tmp_path):
    from k3 import K3Config
    from k3.train.state import find_checkpoint, load_checkpoint

    run(tmp_path, "c", steps=1)
    ck = find_checkpoint(tmp_path / "c")
    other = K3Config.preset("tiny").replace(vocab_size=K3Config.from_hf(ck).vocab_size, hidden_size=96)
    with pytest.raises(CheckpointError, match="hidden_size"):
        load_checkpoint(ck, other)


@pytest.mark.slow
def test_train_plot_generate_cli(tmp_path, capsys):
    out = tmp_path / "cli"
    args = ["train", "--preset", "tiny", "--out", str(out), "--steps", "3", "--batch-size", "2", "--seq-len", "64",
            "--vocab-size", "512", "--data-max-bytes", "300000", "--eval-every", "3", "--log-every", "1"]
    assert main(args) == 0
    assert "val_loss" in capsys.readouterr().out
    assert main(["plot", str(out)]) == 0
    assert (out / "loss.png").stat().st_size > 1000 and (out / "load.png").exists()
    assert json.loads((out / "run_info.json").read_text())["load_layers"][0] == "layer 2"  # 1-based
    assert capsys.readouterr().out.splitlines() == [str(out / "loss.png"), str(out / "load.png")]
    assert main(["generate", "--checkpoint", str(out), "--prompt", "import os", "--max-tokens", "8",
                 "--temperature", "0"]) == 0
    assert capsys.readouterr().out.startswith("import os")
    assert main(["plot", str(tmp_path / "nothing")]) == 1


@pytest.mark.slow
def test_training_on_user_jsonl_learns(tmp_path):
    data = tmp_path / "d.jsonl"
    text = "the quick brown fox jumps over the lazy dog. " * 40
    data.write_text("\n".join(json.dumps({"text": f"{i}: {text}"}) for i in range(60)))
    cfg, result = run(tmp_path, "j", data=str(data), data_max_bytes=None, steps=12, vocab_size=300,
                      eval_every=12, lr=5e-3)
    recs = read_metrics(cfg.out)
    assert recs[-1]["loss"] < recs[0]["loss"] - 1.0
    assert torch.isfinite(torch.tensor(recs[-1]["val_loss"]))


@pytest.mark.slow
def test_rerunning_a_finished_run_says_so_and_a_larger_steps_extends_it(tmp_path, capsys):
    out = tmp_path / "x"
    args = ["train", "--preset", "tiny", "--out", str(out), "--steps", "3", "--batch-size", "2", "--seq-len", "32",
            "--vocab-size", "300", "--data-max-bytes", "200000", "--eval-every", "3", "--log-every", "1"]
    assert main(args) == 0
    capsys.readouterr()
    assert main(args) == 0  # the same command again: nothing to do, and no "loss nan"
    printed = capsys.readouterr().out
    assert "already complete" in printed and "step 3" in printed and "larger --steps" in printed
    assert "nan" not in printed
    assert main(args[:5] + ["--steps", "5"] + args[7:]) == 0  # extended: resumes at 3, ends at 5
    recs = read_metrics(out)
    assert [r["step"] for r in recs] == [1, 2, 3, 4, 5] and "val_loss" in recs[-1]
    floor = BASE.lr * BASE.min_lr_ratio  # the finished schedule had reached its minimum: it goes on there
    assert recs[3]["lr"] == pytest.approx(floor) and recs[4]["lr"] == pytest.approx(floor)
    assert main(args[:5] + ["--steps", "6", "--lr", "1e-3"] + args[7:]) == 1
    err = capsys.readouterr().err
    assert "--lr 0.003 (now 0.001)" in err and "new --out" in err


@pytest.mark.slow
def test_extending_a_run_half_way_keeps_the_lr_continuous(tmp_path):
    from k3.train.schedule import lr_lambda

    cfg, _ = run(tmp_path, "h", steps=8, stop_after=3, eval_every=100)
    run(tmp_path, "h", steps=12, eval_every=100)
    lrs = [r["lr"] for r in read_metrics(cfg.out)]
    assert len(lrs) == 12
    assert lrs[3] == pytest.approx(BASE.lr * lr_lambda(3, 8))  # step 4 keeps the lr it would have had
    assert all(a > b for a, b in zip(lrs[3:], lrs[4:]))  # then decays, more slowly, over the 9 steps left
    assert lrs[-1] > BASE.lr * BASE.min_lr_ratio and lrs[7] > BASE.lr * lr_lambda(7, 8)


@pytest.mark.slow
def test_memory_policies_train_the_same_curve_with_less_saved(tmp_path):
    """`k3 train --memory-policy`: the same losses and gradient norms (to float rounding: 1e-6 relative), fewer
    saved bytes logged."""
    curves = {}
    for policy in ("keep", "efficient", "recompute"):
        cfg, _ = run(tmp_path, policy, steps=2, eval_every=100, memory_policy=policy)
        curves[policy] = read_metrics(cfg.out)
    keep = curves.pop("keep")
    for policy, recs in curves.items():
        for r, k in zip(recs, keep):
            assert r["loss"] == pytest.approx(k["loss"], rel=1e-6) and r["grad_norm"] == pytest.approx(k["grad_norm"],
                                                                                                      rel=1e-6), policy
        assert all(0 < r["saved_activation_bytes"] < k["saved_activation_bytes"] for r, k in zip(recs, keep)), policy


@pytest.mark.slow
def test_a_run_saved_without_eos_token_id_still_resumes(tmp_path):
    """Checkpoints written before k3 train recorded the tokenizer's eos_token_id resume as they are."""
    from k3.checkpoint.manifest import record_checksums

    cut, _ = run(tmp_path, "old", stop_after=3)
    ck = tmp_path / "old" / "checkpoint"
    cfg = json.loads((ck / "config.json").read_text())
    cfg.pop("eos_token_id")
    (ck / "config.json").write_text(json.dumps(cfg))
    (ck / "generation_config.json").unlink()
    record_checksums(ck, [p.name for p in ck.iterdir() if p.name != "SHA256SUMS"])
    run(tmp_path, "old")
    assert [r["step"] for r in read_metrics(cut.out)] == list(range(1, 7))
