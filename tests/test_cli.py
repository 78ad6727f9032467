import json
import subprocess
import sys

from k3.cli import main


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


def test_python_dash_m_entry_point():
    r = subprocess.run([sys.executable, "-m", "k3", "params", "--preset", "tiny"], capture_output=True, text=True)
    assert r.returncode == 0 and "TOTAL" in r.stdout
