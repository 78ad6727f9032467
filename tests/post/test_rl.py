"""k3 rl / k3 distill end to end on CPU: a resumed run equals an uninterrupted one (carried trajectories
included); MOPD with the student as its own teacher gives zero reward."""

import dataclasses

import pytest
import torch

from k3.config import K3Config
from k3.data import save_tokenizer
from k3.model.transformer import K3ForCausalLM
from k3.post.rl import RLConfig, rl_train
from k3.train.loop import TrainConfig
from k3.train.metrics import read_metrics

TIMING = ("rollout_s", "step_s", "tokens_per_s")


@pytest.fixture
def sft_ckpt(tmp_path, chat_tokenizer):
    torch.manual_seed(0)
    model = K3ForCausalLM(K3Config.preset("tiny").replace(vocab_size=chat_tokenizer.get_vocab_size()))
    d = tmp_path / "sft"
    model.save_pretrained(d)
    save_tokenizer(chat_tokenizer, d / "tokenizer.json")
    return d


def config(tmp_path, ckpt, name, **kw):
    train = TrainConfig(**{"out": str(tmp_path / name), "init_from": str(ckpt), "steps": 3, "lr": 1e-3,
                           "log_every": 1, "save_every": 100, "warmup_frac": 0.0, **kw.pop("train", {})})
    return RLConfig(**{"train": train, "tasks": ("arithmetic", "sorting"), "efforts": ("low", "max"), "samples": 2,
                       "prompts": 2, "max_tokens": 10, "chunk": 4, "budget_prompts": 2, **kw})


def test_resumed_rl_equals_the_uninterrupted_run(tmp_path, sft_ckpt):
    straight = config(tmp_path, sft_ckpt, "a")
    rl_train(straight, log=lambda *a: None)
    cut = config(tmp_path, sft_ckpt, "b", train={"stop_after": 1})
    rl_train(cut, log=lambda *a: None)
    rl_train(config(tmp_path, sft_ckpt, "b"), log=lambda *a: None)
    a, b = read_metrics(straight.train.out), read_metrics(cut.train.out)
    assert [r["step"] for r in a] == [1, 2, 3] == [r["step"] for r in b]
    strip = lambda r: {k: v for k, v in r.items() if k not in TIMING}  # noqa: E731
    assert [strip(r) for r in a] == [strip(r) for r in b]
    r = a[0]
    assert {"reward", "accuracy", "clip_frac", "length/low", "length/max", "tau/low", "carried", "loss"} <= set(r)
    assert all(0 < x["rollout_tokens"] <= 2 * 2 * 10 and x["groups"] >= 1 for x in a)


def test_mopd_with_the_student_as_teacher_has_zero_reward(tmp_path, sft_ckpt):
    cfg = config(tmp_path, sft_ckpt, "d", train={"steps": 1}, chunk=None,
                 teachers={f"{t}:{e}": str(sft_ckpt) for t in ("arithmetic", "sorting") for e in ("low", "max")})
    rl_train(cfg, log=lambda *a: None)
    [rec] = read_metrics(cfg.train.out)
    assert abs(rec["reward"]) < 1e-4  # log pi_T - log pi_S = 0 token by token: the engine's log-probs line up
    assert rec["grad_norm"] < 1e-3
    with pytest.raises(ValueError, match="no teacher for arithmetic:max, sorting:low, sorting:max"):
        rl_train(dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, out=str(tmp_path / "e")),
                                     teachers={"arithmetic:low": str(sft_ckpt)}), log=lambda *a: None)


def test_rl_metrics_plot(tmp_path, sft_ckpt):
    from k3.cli.plot import plot_run

    cfg = config(tmp_path, sft_ckpt, "p", train={"steps": 2}, chunk=None)
    rl_train(cfg, log=lambda *a: None)
    assert sorted(p.name for p in plot_run(cfg.train.out)) == ["load.png", "loss.png", "rl.png"]
