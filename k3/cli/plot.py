"""k3 plot: loss and expert-load curves of a run, as PNG files beside its metrics.jsonl.

Legends sit outside the axes, so they never cover a curve; MoE layers are numbered from 1, as in the README.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..train.metrics import read_metrics

HELP = "render RUN_DIR/metrics.jsonl to loss.png and load.png (and rl.png for k3 rl / distill runs)"


def add_arguments(p) -> None:
    p.add_argument("run_dir", help="a k3 train/demo output directory")


def _finish(fig, ax, ylabel: str, **legend):
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0, **legend)
    fig.tight_layout()
    return fig


def loss_figure(recs: list[dict], info: dict):
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4))
    ax.plot([r["step"] for r in recs], [r["loss"] for r in recs], label="train loss")
    val = [r for r in recs if "val_loss" in r]
    if val:
        ax.plot([r["step"] for r in val], [r["val_loss"] for r in val], "o-", label="validation loss")
    h = info.get("unigram_entropy_nats")
    if h:
        ax.axhline(h, color="gray", ls="--", label=f"unigram entropy ({h:.2f})")
    return _finish(fig, ax, "loss (nats/token)")


def load_figure(loads: list[dict], info: dict):
    """The worst layer's max/mean expert load and each MoE layer's, labelled as ``run_info.json`` names them."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4))
    steps = [r["step"] for r in loads]
    ax.plot(steps, [r["load_max_over_mean"] for r in loads], label="worst layer")
    n = len(loads[0].get("load_per_layer", []))
    labels = info.get("load_layers") or [f"MoE layer {i + 1}" for i in range(n)]  # runs before load_layers
    for i in range(n):
        ax.plot(steps, [r["load_per_layer"][i] for r in loads], lw=0.8, alpha=0.6, label=labels[i])
    ax.axhline(1.0, color="gray", ls="--")
    return _finish(fig, ax, "expert load max / mean", fontsize=7, ncols=1 + n // 16)


def rl_figure(recs: list[dict]):
    """k3 rl / k3 distill: reward and accuracy of the step's rollouts, reply length per effort, held-out accuracy."""
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(12, 4))
    steps = [r["step"] for r in recs]
    for key in ("reward", "accuracy", "clip_frac"):
        ax.plot(steps, [r.get(key) for r in recs], label=key)
    for key in sorted({k for r in recs for k in r if k.startswith("eval_accuracy/")}):
        ev = [r for r in recs if key in r]
        ax.plot([r["step"] for r in ev], [r[key] for r in ev], "o-", label=key.replace("eval_accuracy/", "held-out "))
    for key in sorted({k for r in recs for k in r if k.startswith("length/")}):
        bx.plot(steps, [r.get(key) for r in recs], label=key.replace("length/", "length, "))
    bx.set_xlabel("step")
    bx.set_ylabel("reply tokens")
    bx.legend()
    return _finish(fig, ax, "reward / accuracy")


def plot_run(run_dir: str | Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run_dir = Path(run_dir)
    recs = read_metrics(run_dir)
    if not recs:
        raise ValueError(f"{run_dir / 'metrics.jsonl'} is empty: nothing to plot yet")
    info = json.loads((run_dir / "run_info.json").read_text()) if (run_dir / "run_info.json").exists() else {}
    figures = {"loss.png": loss_figure([r for r in recs if "loss" in r], info)}
    if any("reward" in r for r in recs):
        figures["rl.png"] = rl_figure([r for r in recs if "reward" in r])
    loads = [r for r in recs if "load_max_over_mean" in r]
    if loads:
        figures["load.png"] = load_figure(loads, info)
    out = []
    for name, fig in figures.items():
        fig.savefig(run_dir / name, dpi=110, bbox_inches="tight")
        plt.close(fig)
        out.append(run_dir / name)
    return out


def run(args) -> int:
    for p in plot_run(args.run_dir):
        print(p)
    return 0
