"""k3 sft: the labels are exactly the assistant's tokens; a resumed run equals an uninterrupted one; it learns."""

import dataclasses
import json

import pytest

from k3.cli import main
from k3.data import PackedDataset
from k3.distributed.plan import ParallelDims, ParallelPlan
from k3.post.format import ChatFormat
from k3.post.sft_data import encode_conversation, load_conversations
from k3.train.loop import TrainConfig, train
from k3.train.metrics import read_metrics

SFT = TrainConfig(out="", preset="tiny", chat=True, vocab_size=300, steps=6, batch_size=2, seq_len=64, lr=3e-3,
                  eval_every=3, eval_batches=2, log_every=1, save_every=100, val_fraction=0.1)


def sft(tmp_path, data, name, **kw):
    from k3.post.sft_data import prepare

    cfg = dataclasses.replace(SFT, out=str(tmp_path / name), data=str(data), **kw)
    return cfg, train(cfg, ParallelPlan(ParallelDims(), cfg.device), log=lambda *a: None, prepare=prepare)


def test_labels_are_exactly_the_assistant_tokens(chat_tokenizer):
    fmt = ChatFormat(chat_tokenizer)
    msgs = [{"role": "user", "content": "What is 1 + 2?"}, {"role": "assistant", "content": "3"},
            {"role": "user", "content": "And 2 + 2?"}, {"role": "assistant", "content": "4", "reasoning_content": "2+2"}]
    [(ids, labels, images, starts)] = encode_conversation(fmt, msgs, "high")
    assert images == starts == ()
    # the whole conversation is the prompt of the last turn + its completion; every earlier token is the prompt
    # of the first turn, its completion, then the second turn's prompt
    p1, c1 = fmt.prompt_ids(msgs[:1], "high"), fmt.completion_ids(msgs[1], "high")
    p2, c2 = fmt.prompt_ids(msgs[:3], "high"), fmt.completion_ids(msgs[3], "high")
    assert ids == p2 + c2 and p2[:len(p1) + len(c1)] == p1 + c1
    want = [-100] * len(p1) + c1 + [-100] * (len(p2) - len(p1) - len(c1)) + c2
    assert labels == want
    assert chat_tokenizer.decode([t for t in labels if t != -100]) == \
        "3<|im_end|><think>\n2+2\n</think>\n4<|im_end|>"
    assert "Reasoning effort: high." in chat_tokenizer.decode(ids[:len(p1)])
    # packed: the labels travel with their tokens, -100 at every other position (the EOS between documents too)
    ds = PackedDataset([ids, ids], 2 * len(ids) + 2, 0, shuffle_seed=None, drop_last=False, label_docs=[labels, labels])
    b = next(ds.eval_batches(100))
    t, lab = b["input_ids"].flatten().tolist(), b["labels"].flatten().tolist()
    assert [x for x, y in zip(t, lab) if y != -100] == [x for x in labels if x != -100] * 2


def test_bad_chat_lines_are_named(tmp_path):
    p = tmp_path / "bad.jsonl"
    p.write_text('{"messages": [{"role": "user", "content": "hi"}]}\n')
    with pytest.raises(ValueError, match="bad.jsonl:1: no assistant message"):
        load_conversations(p)
    p.write_text('{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "x"}], '
                 '"effort": "medium"}\n')
    with pytest.raises(ValueError, match="effort.*medium"):
        load_conversations(p)


def test_resumed_sft_equals_the_uninterrupted_run(tmp_path, chat_jsonl):
    a, _ = sft(tmp_path, chat_jsonl, "straight")
    b, _ = sft(tmp_path, chat_jsonl, "cut", stop_after=3)
    sft(tmp_path, chat_jsonl, "cut")
    key = lambda out: [(r["step"], r["loss"], r.get("val_loss")) for r in read_metrics(out)]  # noqa: E731
    assert [s for s, *_ in key(a.out)] == list(range(1, 7))
    assert key(a.out) == key(b.out)


@pytest.mark.slow
def test_sft_loss_falls_and_the_cli_runs(tmp_path, chat_jsonl, capsys):
    out = tmp_path / "cli"
    assert main(["sft", "--data", str(chat_jsonl), "--out", str(out), "--steps", "30", "--batch-size", "4",
                 "--seq-len", "64", "--vocab-size", "300", "--eval-every", "30", "--log-every", "1",
                 "--lr", "3e-3"]) == 0
    recs = read_metrics(out)
    first, last = recs[0]["loss"], sum(r["loss"] for r in recs[-5:]) / 5
    assert last < 0.6 * first, (first, last)
    assert "on assistant tokens" in capsys.readouterr().out
    info = json.loads((out / "run_info.json").read_text())
    assert info["train_config"]["chat"] is True
    assert (out / "checkpoint" / "tokenizer.json").exists()


def test_a_lone_surrogate_in_chat_data_is_one_line_naming_file_line_and_field(tmp_path, capsys):
    p = tmp_path / "chat.jsonl"
    good = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
    p.write_text(json.dumps(good) + "\n" + json.dumps(good).replace("hello", "\\ud800") + "\n")
    out = tmp_path / "run"
    assert main(["sft", "--data", str(p), "--out", str(out), "--steps", "1"]) == 1
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert f'{p}:2: a lone surrogate \\ud800 in "messages[1].content"' in err
    assert not out.exists()  # the failed run leaves no empty --out
