"""`k3 train --data` on what a user has at hand (one text file, a short JSONL, a few files) trains and reports a
validation loss; too little data is refused with how much more is needed."""

import json
import sysconfig
from pathlib import Path

import pytest

from k3.cli import main

ARGS = ["--steps", "2", "--batch-size", "2", "--seq-len", "32", "--vocab-size", "300", "--eval-every", "2",
        "--log-every", "1"]
STDLIB = Path(sysconfig.get_paths()["stdlib"])


def prose(n_chars: int, seed: int = 0) -> str:
    """Paragraphs of real English (the standard library's docstrings and comments), blank-line separated."""
    lines = [ln.strip(' #"') for f in sorted(STDLIB.glob("[a-m]*.py"))[seed:seed + 60]
             for ln in f.read_text(errors="replace").splitlines() if ln.strip().startswith("#")]
    paras, text = [" ".join(lines[i:i + 6]) for i in range(0, len(lines), 6)], ""
    for p in paras:
        text += p + "\n\n"
        if len(text) >= n_chars:
            return text
    raise AssertionError("not enough text")


def train_cli(capsys, data, out, *extra) -> str:
    assert main(["train", "--data", str(data), "--out", str(out), *ARGS, *extra]) == 0
    printed = capsys.readouterr().out
    assert "val_loss" in printed and "nan" not in printed
    return printed


@pytest.mark.slow
def test_one_text_file(tmp_path, capsys):
    book = tmp_path / "book.txt"
    book.write_text(prose(40_000))  # one file: cut at blank lines into documents of <= 8192 characters
    train_cli(capsys, book, tmp_path / "run")
    info = json.loads((tmp_path / "run" / "run_info.json").read_text())
    assert info["val_sequences"] >= 1 and info["train_sequences"] > 10


@pytest.mark.slow
def test_a_ten_line_jsonl(tmp_path, capsys):
    rows = tmp_path / "rows.jsonl"
    text = prose(8_000, seed=3).split("\n\n")
    rows.write_text("".join(json.dumps({"text": t}) + "\n" for t in text[:10]))
    assert len(rows.read_text().splitlines()) == 10
    train_cli(capsys, rows, tmp_path / "run")


@pytest.mark.slow
def test_a_directory_of_five_files(tmp_path, capsys):
    corpus = tmp_path / "notes"
    corpus.mkdir()
    for i in range(5):
        (corpus / f"note{i}.md").write_text(prose(1_500, seed=i))
    train_cli(capsys, corpus, tmp_path / "run")


@pytest.mark.slow
def test_too_little_data_says_how_much_is_needed(tmp_path, capsys):
    one = tmp_path / "one.txt"
    one.write_text(prose(1_000).replace("\n\n", " "))  # one paragraph: one document
    assert main(["train", "--data", str(one), "--out", str(tmp_path / "a"), *ARGS]) == 1
    err = capsys.readouterr().err
    assert "one document of" in err and "validation" in err and "--doc-chars below" in err
    train_cli(capsys, one, tmp_path / "b", "--doc-chars", "300")  # what the message suggests works
    assert main(["train", "--data", str(one), "--out", str(tmp_path / "c"), *ARGS, "--seq-len", "4096",
                 "--doc-chars", "300"]) == 1
    err = capsys.readouterr().err
    assert "less than one sample of --seq-len 4096" in err and "more characters of text" in err
    assert "--seq-len of at most" in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("bad", [dict(steps=0), dict(seq_len=2), dict(eval_every=0), dict(mtp_weight=-1.0),
                                 dict(lr=float("nan")), dict(val_fraction=0.0), dict(data_max_bytes=0)])
def test_train_config_names_a_bad_field(bad):
    from k3.train.loop import TrainConfig

    with pytest.raises(ValueError, match=f"TrainConfig.{next(iter(bad))} "):
        TrainConfig(out="x", **bad)
