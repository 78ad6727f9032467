"""k3 plot: loss and expert-load curves of a run, as PNG files beside its metrics.jsonl."""

from __future__ import annotations

from pathlib import Path

from ..train.metrics import read_metrics

HELP = "render RUN_DIR/metrics.jsonl to loss.png and load.png"


def add_arguments(p) -> None:
    p.add_argument("run_dir", help="a k3 train/demo output directory")


def plot_run(run_dir: str | Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run_dir = Path(run_dir)
    recs = read_metrics(run_dir)
    if not recs:
        raise ValueError(f"{run_dir / 'metrics.jsonl'} is empty: nothing to plot yet")
    out = []
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([r["step"] for r in recs], [r["loss"] for r in recs], label="train loss")
    val = [r for r in recs if "val_loss" in r]
    if val:
        ax.plot([r["step"] for r in val], [r["val_loss"] for r in val], "o-", label="validation loss")
    info = run_dir / "run_info.json"
    if info.exists():
        import json

        h = json.loads(info.read_text()).get("unigram_entropy_nats")
        if h:
            ax.axhline(h, color="gray", ls="--", label=f"unigram entropy ({h:.2f})")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(run_dir / "loss.png", dpi=110)
    plt.close(fig)
    out.append(run_dir / "loss.png")
    loads = [r for r in recs if "load_max_over_mean" in r]
    if loads:
        fig, ax = plt.subplots(figsize=(7, 4))
        ax.plot([r["step"] for r in loads], [r["load_max_over_mean"] for r in loads], label="max / mean (all layers)")
        if "load_per_layer" in loads[0]:
            for i in range(len(loads[0]["load_per_layer"])):
                ax.plot([r["step"] for r in loads], [r["load_per_layer"][i] for r in loads], lw=0.8, alpha=0.6,
                        label=f"MoE layer {i}")
        ax.axhline(1.0, color="gray", ls="--")
        ax.set_xlabel("step")
        ax.set_ylabel("expert load max / mean")
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(run_dir / "load.png", dpi=110)
        plt.close(fig)
        out.append(run_dir / "load.png")
    return out


def run(args) -> int:
    for p in plot_run(args.run_dir):
        print(p)
    return 0
