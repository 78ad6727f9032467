"""`torchrun --nproc_per_node 2 -m k3 train --dp 2` (FSDP2, gloo) against one process at the same global batch."""

import json
import os
import subprocess
import sys

import pytest

ARGS = ["--preset", "tiny", "--steps", "4", "--seq-len", "64", "--vocab-size", "512", "--data-max-bytes", "300000",
        "--eval-every", "2", "--log-every", "1", "--save-every", "2", "--device", "cpu"]


def _run(cmd, out):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    r = subprocess.run(cmd + ARGS + ["--out", str(out)], capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.distributed
def test_dp2_reproduces_the_single_process_loss_curve(tmp_path):
    single = _run([sys.executable, "-m", "k3", "train", "--batch-size", "4"], tmp_path / "one")
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "-m", "k3", "train"]
    dp = _run(torchrun + ["--batch-size", "2", "--dp", "2"], tmp_path / "dp")
    assert [r["step"] for r in dp] == [1, 2, 3, 4]
    for a, b in zip(single, dp):
        # same samples, the global token mean in both: equal up to float summation order (stated tolerance 1e-5)
        assert abs(a["loss"] - b["loss"]) < 1e-5 * a["loss"], (a, b)
        assert a.get("val_loss") == pytest.approx(b.get("val_loss"), rel=1e-5) if "val_loss" in a else True
        # Quantile Balancing's histogram all-reduce gives the biases of the single-process global batch
        assert a["load_max_over_mean"] == b["load_max_over_mean"]
        assert a["tokens"] == b["tokens"]
    ck = tmp_path / "dp" / "checkpoint"
    assert (ck / "optimizer.rank0.pt").exists() and (ck / "optimizer.rank1.pt").exists()
    assert (ck / "model.safetensors").exists()


@pytest.mark.distributed
def test_dp_refuses_a_mismatched_process_count(tmp_path):
    r = subprocess.run([sys.executable, "-m", "k3", "train", "--dp", "2"] + ARGS + ["--out", str(tmp_path / "x")],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 1 and "torchrun --nproc_per_node" in r.stderr


@pytest.mark.distributed
def test_dp_resume_equals_uninterrupted(tmp_path):
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "-m", "k3", "train",
                "--batch-size", "2", "--dp", "2"]
    straight = _run(torchrun, tmp_path / "a")
    _run(torchrun + ["--stop-after", "2"], tmp_path / "b")
    resumed = _run(torchrun, tmp_path / "b")  # the same command again resumes from step 2
    assert [(r["step"], r["loss"]) for r in resumed] == [(r["step"], r["loss"]) for r in straight]


@pytest.mark.distributed
def test_cp2_reproduces_the_single_process_loss_curve(tmp_path):
    """`--cp 2`: every sequence split along time over two ranks (KCP in the KDA layers, gathered MLA latents),
    the MTP layer and QK-clip included."""
    common = ["--batch-size", "2"]
    single = _run([sys.executable, "-m", "k3", "train"] + common, tmp_path / "one")
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "-m", "k3", "train"]
    cp = _run(torchrun + common + ["--cp", "2"], tmp_path / "cp")
    for a, b in zip(single, cp):
        assert abs(a["loss"] - b["loss"]) < 1e-5 * a["loss"], (a, b)
        assert a["load_max_over_mean"] == b["load_max_over_mean"]
    assert [r["step"] for r in cp] == [1, 2, 3, 4]


@pytest.mark.distributed
def test_ep2_reproduces_the_single_process_loss_curve_and_saves_full_experts(tmp_path):
    """`--ep 2`: routed experts sharded over two ranks, MoonEP-balanced all-to-all dispatch."""
    single = _run([sys.executable, "-m", "k3", "train", "--batch-size", "4"], tmp_path / "one")
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "-m", "k3", "train"]
    ep = _run(torchrun + ["--batch-size", "2", "--ep", "2"], tmp_path / "ep")
    for a, b in zip(single, ep):
        assert abs(a["loss"] - b["loss"]) < 1e-5 * a["loss"], (a, b)
        assert a["load_max_over_mean"] == b["load_max_over_mean"]
    from k3.checkpoint import load_pretrained

    full = load_pretrained(tmp_path / "ep" / "checkpoint")  # the experts were gathered back to [E, ...]
    assert full.model.layers[1].block_sparse_moe.experts.w1.shape[0] == full.config.num_experts
    ref = load_pretrained(tmp_path / "one" / "checkpoint").state_dict()
    worst = max((v - ref[k]).abs().max().item() for k, v in full.state_dict().items())
    assert worst < 1e-4  # every weight, MTP and router biases included, after 4 steps (measured ~1e-5)


@pytest.mark.distributed
def test_dp2_x_cp2_on_a_2d_mesh_reproduces_one_process(tmp_path):
    """4 processes: FSDP2 over "dp", each dp slice's sequences split along time over "cp"."""
    common = ["--mtp-weight", "0"]
    single = _run([sys.executable, "-m", "k3", "train", "--batch-size", "4"] + common, tmp_path / "one")
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "4", "-m", "k3", "train"]
    mesh = _run(torchrun + ["--batch-size", "2", "--dp", "2", "--cp", "2"] + common, tmp_path / "mesh")
    for a, b in zip(single, mesh):
        assert abs(a["loss"] - b["loss"]) < 1e-5 * a["loss"], (a, b)
        assert a["load_max_over_mean"] == b["load_max_over_mean"]
    assert [r["step"] for r in mesh] == [1, 2, 3, 4]
