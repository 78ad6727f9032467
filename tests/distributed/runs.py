"""`k3 train` runs under torchrun for the loss-curve tests: the common arguments, the device and the tolerances.

With K3_TEST_BACKEND=nccl every run passes ``--device cuda`` (torchrun's ranks then take NCCL and cuda:LOCAL_RANK)
and K3_KDA_BACKEND=torch (unless set); the tolerances then allow for bf16 autocast (below).
"""

import json
import os
import subprocess
import sys

from .gloo import NCCL

DEVICE = "cuda" if NCCL else "cpu"
# gloo (CPU, fp32): equal up to float summation order, router loads exactly equal. NCCL (CUDA): the training loop
# runs under bf16 autocast, whose GEMMs round differently for different shapes (a rank's half of the batch or of the
# sequence), and routing near-ties may flip; measured on 2 H200s over the 4 steps: losses within 1.1e-4 relative,
# load_max_over_mean within 0.05, weights within 0.013 (an AdamW entry whose tiny gradient flips sign moves ~lr the
# other way each step; gathering the experts in a wrong order would show ~0.35)
LOSS_RTOL = 1e-3 if NCCL else 1e-5
LOAD_ATOL = 0.15 if NCCL else 0.0
WEIGHT_ATOL = 0.05 if NCCL else 1e-4
ARGS = ["--preset", "tiny", "--steps", "4", "--seq-len", "64", "--vocab-size", "512", "--data-max-bytes", "300000",
        "--eval-every", "2", "--log-every", "1", "--save-every", "2", "--device", DEVICE]
ONE = [sys.executable, "-m", "k3", "train"]


def torchrun(n: int) -> list[str]:
    """The command prefix of ``torchrun --nproc_per_node n -m k3 train``."""
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(n), "-m", "k3", "train"]


def run(cmd, out, timeout: int = 600) -> subprocess.CompletedProcess:
    """Run ``cmd + ARGS --out out`` (one OMP thread per process) and return it, whatever its exit status."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if NCCL:
        env.setdefault("K3_KDA_BACKEND", "torch")  # the reference kernels in every run, as in the spawned tests
    return subprocess.run(cmd + ARGS + ["--out", str(out)], capture_output=True, text=True, env=env, timeout=timeout)


def train_run(cmd, out) -> list[dict]:
    """Run ``cmd + ARGS --out out`` and return its metrics.jsonl records (the run must succeed)."""
    r = run(cmd, out)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def assert_curves_match(single: list[dict], multi: list[dict], keys=("loss", "mtp_loss", "grad_norm")) -> None:
    """The multi-process run's logged curve equals the single-process one at the same global batch: ``keys``
    within LOSS_RTOL, val_loss too, Quantile Balancing's loads (the histogram all-reduce pools the global batch)
    within LOAD_ATOL (exactly, per layer, on CPU), the same token counts."""
    assert [r["step"] for r in multi] == [r["step"] for r in single]
    for a, b in zip(single, multi):
        for key in keys:
            assert abs(a[key] - b[key]) < LOSS_RTOL * a[key], (key, a, b)
        if "val_loss" in a:
            assert abs(a["val_loss"] - b["val_loss"]) < LOSS_RTOL * a["val_loss"], (a, b)
        assert abs(a["load_max_over_mean"] - b["load_max_over_mean"]) <= LOAD_ATOL, (a, b)
        if not LOAD_ATOL:
            assert a["load_per_layer"] == b["load_per_layer"]
        assert a["tokens"] == b["tokens"]


def assert_same_checkpoint(one, multi, ranks: int) -> float:
    """``multi``'s checkpoint (one optimiser shard per rank) holds the single-process names and shapes (experts
    gathered back to one tensor) and weights within WEIGHT_ATOL of ``one``'s; returns the worst difference."""
    from safetensors.torch import load_file

    assert all((multi / f"optimizer.rank{r}.pt").exists() for r in range(ranks))
    ref, got = load_file(one / "model.safetensors"), load_file(multi / "model.safetensors")
    assert set(got) == set(ref)  # official names
    assert {k: v.shape for k, v in got.items()} == {k: v.shape for k, v in ref.items()}
    worst = max((got[k].float() - v.float()).abs().max().item() for k, v in ref.items())
    assert worst < WEIGHT_ATOL, worst  # every weight and router bias
    return worst
