"""k3 demo: the main job on the embedded default data, sized for a laptop CPU.

Trains the ``tiny`` K3 (every mechanism: KDA + MLA, Block AttnRes, Stable LatentMoE with Quantile Balancing,
MTP, Muon) on the Python standard library's source, prints the validation loss as it falls, saves the
checkpoint and a loss plot, and samples a continuation.

It runs on one CPU thread (``--threads 1``): the tiny model's ops take 20-200 us each, so splitting each over
cores costs more in the threads' hand-off than it saves, and on a shared machine a thread waiting for a busy core
stalls every op (one training step on a loaded 2-core CPU: 0.5-1.0 s with one thread, 9-17 s with two).
"""

from __future__ import annotations


from ..train.loop import TrainConfig
from .common import add_model_arguments, add_threads_argument, apply_threads
from .train import add_train_arguments, config_from_args, run_training

HELP = "train the tiny K3 on the embedded standard-library corpus for a few minutes, plot, and sample"

DEMO = TrainConfig(out="runs/demo", preset="tiny", data_max_bytes=12_000_000, tokenizer_bytes=3_000_000,
                   vocab_size=2048, steps=500, batch_size=8, seq_len=256, lr=3e-3, eval_every=50, eval_batches=8,
                   log_every=10, device="auto")


def add_arguments(p) -> None:
    add_model_arguments(p, default_preset="tiny")
    add_train_arguments(p, DEMO)
    add_threads_argument(p, 1)
    p.add_argument("--prompt", default="def fibonacci(n):\n", help="text to continue after training")


def run(args) -> int:
    from ..inference.load import load_for_inference
    from .generate import generate_text
    from .plot import plot_run

    apply_threads(args)
    cfg = config_from_args(args, DEMO)
    print(f"k3 demo: training the {cfg.preset or cfg.config} K3 for {cfg.steps} steps "
          f"({cfg.batch_size} x {cfg.seq_len} tokens each) on the Python standard library; output in {cfg.out}")
    result, rank = run_training(cfg, command="demo")
    if result is None:
        return 130
    if rank != 0:
        return 0
    h = result["unigram_entropy"]
    vals = _val_curve(cfg.out)
    print("validation loss by step: " + ", ".join(f"{s}: {v:.3f}" for s, v in vals))
    print(f"final validation loss {vals[-1][1]:.3f} nats/token vs unigram entropy {h:.3f} "
          f"({vals[-1][1] / h:.0%} of it)")
    for p in plot_run(cfg.out):
        print(f"plot: {p}")
    model, tok = load_for_inference(cfg.out, "cpu")
    sample = generate_text(model, tok, args.prompt, 80, temperature=0.7, top_k=40, seed=cfg.seed)
    print("sample:\n" + args.prompt + sample)
    return 0


def _val_curve(out):
    from ..train.metrics import read_metrics

    return [(r["step"], r["val_loss"]) for r in read_metrics(out) if "val_loss" in r]



