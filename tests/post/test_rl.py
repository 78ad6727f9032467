"""k3 rl / k3 distill end to end on CPU: a resumed run equals an uninterrupted one (carried trajectories
included); MOPD with the student as its own teacher gives zero reward."""

import dataclasses

import pytest
import torch

from k3.config import K3Config
from k3.data import save_tokenizer
from k3.distributed.plan import ParallelDims, ParallelPlan
from k3.model.transformer import K3ForCausalLM
from k3.post.rl import RLConfig, rl_train
from k3.pretrained import save_pretrained
from k3.train.loop import TrainConfig
from k3.train.metrics import read_metrics

TIMING = ("rollout_s", "step_s", "tokens_per_s")


def rl_train_one(cfg, **kw):
    """``rl_train`` under the one-process plan that ``k3 rl`` builds."""
    return rl_train(cfg, ParallelPlan(ParallelDims(), cfg.train.device), **kw)


@pytest.fixture
def sft_ckpt(tmp_path, chat_tokenizer):
    torch.manual_seed(0)
    model = K3ForCausalLM(K3Config.preset("tiny").replace(vocab_size=chat_tokenizer.get_vocab_size()))
    d = tmp_path / "sft"
    save_pretrained(model, d)
    save_tokenizer(chat_tokenizer, d / "tokenizer.json")
    return d


def config(tmp_path, ckpt, name, **kw):
    train = TrainConfig(**{"out": str(tmp_path / name), "init_from": str(ckpt), "steps": 3, "lr": 1e-3,
                           "log_every": 1, "save_every": 100, "warmup_frac": 0.0, **kw.pop("train", {})})
    return RLConfig(**{"train": train, "tasks": ("arithmetic", "sorting"), "efforts": ("low", "max"), "samples": 2,
                       "prompts": 2, "max_tokens": 10, "chunk": 4, "budget_prompts": 2, **kw})


def test_resumed_rl_equals_the_uninterrupted_run(tmp_path, sft_ckpt):
    straight = config(tmp_path, sft_ckpt, "a")
    rl_train_one(straight, log=lambda *a: None)
    cut = config(tmp_path, sft_ckpt, "b", train={"stop_after": 1})
    rl_train_one(cut, log=lambda *a: None)
    rl_train_one(config(tmp_path, sft_ckpt, "b"), log=lambda *a: None)
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
    rl_train_one(cfg, log=lambda *a: None)
    [rec] = read_metrics(cfg.train.out)
    assert abs(rec["reward"]) < 1e-4  # log pi_T - log pi_S = 0 token by token: the engine's log-probs line up
    assert rec["grad_norm"] < 1e-3
    with pytest.raises(ValueError, match="no teacher for arithmetic:max, sorting:low, sorting:max"):
        rl_train_one(dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, out=str(tmp_path / "e")),
                                     teachers={"arithmetic:low": str(sft_ckpt)}), log=lambda *a: None)


def test_rl_metrics_plot(tmp_path, sft_ckpt):
    from k3.cli.plot import plot_run

    cfg = config(tmp_path, sft_ckpt, "p", train={"steps": 2}, chunk=None)
    rl_train_one(cfg, log=lambda *a: None)
    assert sorted(p.name for p in plot_run(cfg.train.out)) == ["load.png", "loss.png", "rl.png"]


@pytest.fixture
def stopping_ckpt(tmp_path, chat_tokenizer):
    """A tiny model that ends its reply with EOS at varying lengths: uniform over every other token, EOS's logit
    3 x one coordinate of the final norm's output (so groups finish in different rounds)."""
    from k3.data.tokenizer import eos_id

    torch.manual_seed(0)
    model = K3ForCausalLM(K3Config.preset("tiny").replace(vocab_size=chat_tokenizer.get_vocab_size()))
    with torch.no_grad():
        model.lm_head.weight.zero_()
        model.lm_head.weight[eos_id(chat_tokenizer), 0] = 3.0
        model.model.norm.weight.zero_()
        model.model.norm.weight[0] = 1.0
    d = tmp_path / "stopping"
    save_pretrained(model, d)
    save_tokenizer(chat_tokenizer, d / "tokenizer.json")
    return d


def test_partial_rollout_carries_replies_across_steps_and_resumes(tmp_path, stopping_ckpt):
    kw = {"tasks": ("arithmetic",), "efforts": ("max",), "samples": 3, "prompts": 3, "max_tokens": 40, "chunk": 3,
          "train": {"steps": 4}}
    a = config(tmp_path, stopping_ckpt, "ca", **kw)
    rl_train_one(a, log=lambda *x: None)
    recs = read_metrics(a.train.out)
    assert any(r["carried"] > 0 for r in recs[:-1])  # unfinished replies crossed a step boundary ...
    assert any(r["staleness"] > 0 for r in recs)  # ... and were trained on with tokens of an older policy
    b = config(tmp_path, stopping_ckpt, "cb", **{**kw, "train": {"steps": 4, "stop_after": 2}})
    rl_train_one(b, log=lambda *x: None)
    rl_train_one(config(tmp_path, stopping_ckpt, "cb", **kw), log=lambda *x: None)  # resumes with the carried replies
    strip = lambda r: {k: v for k, v in r.items() if k not in TIMING}  # noqa: E731
    assert [strip(r) for r in recs] == [strip(r) for r in read_metrics(b.train.out)]


def test_rl_and_distill_cli(tmp_path, sft_ckpt, capsys):
    from k3.cli import main

    common = ["--init-from", str(sft_ckpt), "--steps", "1", "--tasks", "sorting", "--efforts", "low",
              "--samples", "2", "--prompts", "1", "--max-tokens", "6", "--eval-every", "1", "--eval-problems", "2"]
    assert main(["rl", "--out", str(tmp_path / "rl"), "--budget-prompts", "2", "--tau", "low=0.25", *common]) == 0
    [rec] = read_metrics(tmp_path / "rl")
    assert rec["tau/low"] == 0.25 and "eval_accuracy/sorting/low" in rec
    assert main(["distill", "--out", str(tmp_path / "d"), "--teacher", f"sorting:low={sft_ckpt}", *common]) == 0
    assert "checkpoint in" in capsys.readouterr().out
    assert main(["distill", "--out", str(tmp_path / "e"), "--teacher", "sorting=x", *common]) == 1
    assert "TASK:EFFORT=CHECKPOINT" in capsys.readouterr().err


def test_partial_rollout_without_reencoding_carries_live_requests(tmp_path, stopping_ckpt):
    """reencode=False: the carried replies stay live in the one engine across the weight updates (no request is
    resubmitted after the first), still cross step boundaries and are trained on with an older policy's tokens."""
    from k3.post import rollout as rollout_mod

    submits = []
    real = rollout_mod.Engine.submit

    def counting(self, req):
        submits.append(req.prompt_ids)
        return real(self, req)

    kw = {"tasks": ("arithmetic",), "efforts": ("max",), "samples": 3, "prompts": 3, "max_tokens": 40, "chunk": 3,
          "train": {"steps": 4}}
    cfg = config(tmp_path, stopping_ckpt, "k", reencode=False, **kw)
    rollout_mod.Engine.submit = counting
    try:
        rl_train_one(cfg, log=lambda *x: None)
    finally:
        rollout_mod.Engine.submit = real
    recs = read_metrics(cfg.train.out)
    assert any(r["carried"] > 0 for r in recs[:-1]) and any(r["staleness"] > 0 for r in recs)
    # the budget calibration's 2 requests, then one per trajectory (4 steps x 3 prompts x 3 samples), however
    # many steps it spans: a resubmission would repeat a trajectory's prompt with its tokens so far appended
    assert len(submits) == 2 + 4 * 3 * 3
