import json
import os
import subprocess
import sys
from importlib.metadata import version

import pytest

from k3.cli import main


@pytest.mark.slow
def test_params_json(capsys):
    assert main(["params", "--preset", "kimi-k3", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert abs(r["total"] / 2779.5e9 - 1) < 3e-3 and abs(r["active"] / 104.19e9 - 1) < 3e-3
    assert set(r["by_component"]) >= {"embedding", "kda", "mla", "dense_ffn", "routed_experts", "shared_experts",
                                      "latent_proj", "router", "attn_res", "norms", "head", "mtp"}


def test_params_table_shows_report_figures(capsys):
    assert main(["params", "--preset", "kimi-k2"]) == 0
    out = capsys.readouterr().out
    assert "report: total 1.026T" in out and "32.6B" in out


def test_params_from_config_file(tmp_path, capsys):
    from k3 import K3Config

    K3Config.preset("tiny").save(tmp_path / "config.json")
    assert main(["params", "--config", str(tmp_path)]) == 0
    assert "TOTAL" in capsys.readouterr().out


def test_errors_are_reported_not_raised(tmp_path, capsys):
    (tmp_path / "config.json").write_text('{"text_config": {"hidden_size": -1}}')
    assert main(["params", "--config", str(tmp_path)]) == 1
    assert "hidden_size" in capsys.readouterr().err


@pytest.mark.slow
def test_python_dash_m_entry_point():
    r = subprocess.run([sys.executable, "-m", "k3", "params", "--preset", "tiny"], capture_output=True, text=True)
    assert r.returncode == 0 and "TOTAL" in r.stdout


# ---- misuse: one line naming the argument or file, a non-zero exit, no traceback ----------------------------

def one_line_error(capsys, argv, code) -> str:
    """Run ``k3 argv`` in process; it must exit with ``code`` and say one line on stderr."""
    try:
        got = main(argv)
    except SystemExit as e:  # argparse refuses at parse time
        got = e.code
    out, err = capsys.readouterr()
    assert got == code, (argv, got, err)
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    return err


@pytest.mark.parametrize("argv,named", [
    (["train", "--eval-every", "0"], "--eval-every: must be >= 1; got 0"),
    (["train", "--log-every", "0"], "--log-every: must be >= 1"),
    (["train", "--save-every", "0"], "--save-every: must be >= 1"),
    (["train", "--steps", "0"], "--steps: must be >= 1"),
    (["train", "--grad-accum", "0"], "--grad-accum: must be >= 1"),
    (["train", "--seq-len", "1"], "--seq-len: must be >= 4"),
    (["train", "--data-max-bytes", "0"], "--data-max-bytes: must be >= 1"),
    (["train", "--mtp-weight", "-1"], "--mtp-weight: must be >= 0"),
    (["train", "--lr", "nan"], "--lr: must be a finite number"),
    (["train", "--batch-size", "two"], "--batch-size: expected an integer, got 'two'"),
    (["train", "--vocab-size", "100"], "--vocab-size: must be >= 257"),
    (["train", "--doc-chars", "0"], "--doc-chars: must be >= 1"),
    (["generate", "--checkpoint", "x", "--prompt", "p", "--temperature", "nan"], "--temperature: must be a finite"),
    (["generate", "--checkpoint", "x", "--prompt", "p", "--top-p", "0"], "--top-p: must be > 0 and <= 1"),
    (["generate", "--checkpoint", "x", "--prompt", "p", "--max-tokens", "0"], "--max-tokens: must be >= 1"),
    (["chat", "--checkpoint", "x", "--top-k", "-1"], "--top-k: must be >= 0"),
    (["generate", "--checkpoint", "x", "--prompt", "p", "--seed", str(2**64)], "--seed: must be in [-92233720368"),
    (["train", "--seed", "-9223372036854775809"], "--seed: must be in [-9223372036854775808, 18446744073709551615]"),
    (["serve", "--preset", "tiny", "--random-init", "--port", "99999"], "--port: must be in [1, 65535]"),
    (["params"], "--preset --config is required"),
    (["frobnicate"], "invalid choice: 'frobnicate'"),
    ([], "choose a command"),
])
def test_bad_arguments_are_refused_at_parse_time(capsys, tmp_path, argv, named):
    if argv[:1] == ["train"]:
        argv = argv + ["--out", str(tmp_path / "run")]
    err = one_line_error(capsys, argv, 2)
    assert named in err and "--help" in err
    assert not (tmp_path / "run").exists()


def test_bad_files_and_devices_are_named(capsys, tmp_path):
    from tests.inference.test_cli import make_checkpoint

    run = str(tmp_path / "run")
    import torch

    if not torch.cuda.is_available():
        assert "--device cuda: no CUDA device" in one_line_error(capsys, ["train", "--out", run, "--device", "cuda"], 1)
    assert "--device 'gpu' is not a device" in one_line_error(capsys, ["train", "--out", run, "--device", "gpu"], 1)
    assert "nowhere.txt" in one_line_error(capsys, ["train", "--out", run, "--data", str(tmp_path / "nowhere.txt")], 1)
    nowhere = str(tmp_path / "nowhere")
    assert "no such directory" in one_line_error(capsys, ["generate", "--checkpoint", nowhere, "--prompt", "x"], 1)
    ck = make_checkpoint(tmp_path / "ck")
    argv = ["generate", "--checkpoint", str(ck), "--prompt", "", "--max-tokens", "2"]
    assert "the prompt encodes to no tokens" in one_line_error(capsys, argv, 1)  # nothing echoed before it
    (ck / "tokenizer.json").write_text("")
    assert "tokenizer.json is not a valid tokenizer.json" in one_line_error(capsys, argv, 1)


@pytest.mark.slow
def test_k3_debug_shows_the_traceback(tmp_path):
    argv = [sys.executable, "-m", "k3", "params", "--config", str(tmp_path / "missing.json")]
    quiet = subprocess.run(argv, capture_output=True, text=True)
    loud = subprocess.run(argv, capture_output=True, text=True, env={**os.environ, "K3_DEBUG": "1"})
    assert quiet.returncode == 1 and quiet.stderr.count("\n") == 1 and "missing.json" in quiet.stderr
    assert loud.returncode == 1 and "Traceback (most recent call last)" in loud.stderr


@pytest.mark.slow
def test_a_closed_pipe_is_silent():
    """`k3 params ... | head`: the reader is gone before k3 writes; k3 says nothing and exits 141 (SIGPIPE)."""
    p = subprocess.Popen([sys.executable, "-m", "k3", "params", "--preset", "kimi-k3"], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE)
    p.stdout.close()
    err = p.stderr.read().decode()
    assert p.wait() == 141 and err == ""


def test_version_and_defaults_in_help(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.strip() == f"k3 {version('k3')}"
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for shown in ("--steps STEPS optimiser steps in all; a larger value extends a finished run (default: 1000)",
                  "(default: quantile)", "--seq-len SEQ_LEN tokens per sequence (default: 512)"):
        assert shown in text
    assert "(default: None)" not in text and "(default: False)" not in text


def test_plot_legends_sit_outside_the_curves_and_layers_count_from_one():
    import matplotlib

    matplotlib.use("Agg")
    from k3 import K3Config, K3ForCausalLM
    from k3.cli.plot import load_figure, loss_figure
    from k3.train.metrics import moe_layer_labels

    labels = moe_layer_labels(K3ForCausalLM(K3Config.preset("tiny")))
    cfg = K3Config.preset("tiny")
    assert labels == [f"layer {i + 1}" for i in range(cfg.num_hidden_layers) if cfg.is_moe_layer(i)] + ["MTP 1"]
    assert labels[0] == f"layer {cfg.first_k_dense_replace + 1}"  # numbered from 1, as the README numbers layers
    recs = [{"step": s, "loss": 6 - s / 10, "load_max_over_mean": 2 - s / 30,
             "load_per_layer": [2 - s / 30 + i / 10 for i in range(len(labels))]} for s in range(1, 30)]
    for fig, names in ((load_figure(recs, {"load_layers": labels}), ["worst layer", *labels]),
                       (loss_figure(recs, {"unigram_entropy_nats": 5.5}), ["train loss", "unigram entropy (5.50)"])):
        ax, legend = fig.axes[0], fig.axes[0].get_legend()
        fig.canvas.draw()
        box, area = legend.get_window_extent(), ax.get_window_extent()
        assert box.x0 >= area.x1  # right of the plotting area: it covers no line
        assert [t.get_text() for t in legend.get_texts()] == names
