"""The post-training pipeline on CPU with the tiny preset (SPEC §9): SFT cold start -> RL at max effort on every
task -> RL at low and high effort from it (tau annealed from max's) -> MOPD of the teachers (by default RL max of
each task) into one student from SFT;
held-out accuracy (sampled at temperature 1 and greedy, with standard errors) and reply length at each stage, and
the time per RL step with and without partial rollout.

    python benchmarks/post_demo.py --out runs/post-demo            # ~50 minutes on 2 CPU cores
    python benchmarks/post_demo.py --out runs/post-small --preset small --device cuda --sft-steps 3000 \\
        --rl-steps 300 --max-tokens 512

Stages (``--stages``, in this order): sft, rl (max effort), low (low and high effort from rl), mopd, partial (timing),
eval (evaluate every checkpoint of OUT again).
Writes OUT/results.json (every figure), OUT/accuracy.png (held-out accuracy per stage) and each RL run's rl.png.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import time
from pathlib import Path

import torch

from k3.pretrained import load_pretrained
from k3.data import load_tokenizer
from k3.distributed.plan import ParallelDims, ParallelPlan
from k3.post.evaluate import evaluate_policy
from k3.post.rl import RLConfig, rl_train
from k3.post.sft_data import prepare
from k3.post.tasks import get_task, write_sft_jsonl
from k3.post.tasks.sorting import TRACES as SORTING_TRACES
from k3.train.loop import TrainConfig, resolve_device, train
from k3.train.metrics import read_metrics

EFFORTS = ("low", "high", "max")
TEMPERATURES = {"sampled": 1.0, "greedy": 0.0}


def evaluate(ckpt, tasks, args) -> dict:
    """{"sampled" | "greedy": {"task/effort": {"accuracy", "se", "length", ...}}} on the same test problems."""
    model = load_pretrained(ckpt, dtype=torch.float32).to(args.device)
    tok = load_tokenizer(Path(ckpt) / "tokenizer.json")
    out = {}
    for mode, temp in TEMPERATURES.items():
        res = evaluate_policy(model, tok, tasks, EFFORTS, args.eval_problems, args.max_tokens, temp, seed=1)
        for v in res.values():
            v["se"] = math.sqrt(v["accuracy"] * (1 - v["accuracy"]) / args.eval_problems)
        out[mode] = res
    return out


def rl(args, tasks, name, init, efforts, steps, **kw):
    t = TrainConfig(out=str(Path(args.out) / name), init_from=str(init), steps=steps, lr=args.rl_lr, warmup_frac=0.0,
                    log_every=10, save_every=steps, mtp_weight=0.0, device=args.device, preset=args.preset)
    cfg = RLConfig(train=t, tasks=tuple(tasks), efforts=efforts, samples=args.samples, prompts=args.prompts,
                   max_tokens=args.max_tokens, **kw)
    rl_train(cfg, ParallelPlan(ParallelDims(), resolve_device(args.device)), tasks, log=lambda *a: None)
    return Path(t.out) / "checkpoint", read_metrics(t.out)


def accuracy_figure(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    stages = [s for s in ("sft", "rl_max", "rl_low", "mopd") if s in res]
    keys = list(res["sft"]["sampled"])
    fig, axes = plt.subplots(1, 2, figsize=(13, 4), sharey=True)
    w = 0.8 / len(stages)
    for ax, mode in zip(axes, TEMPERATURES):
        for i, s in enumerate(stages):
            acc = [res[s][mode][k]["accuracy"] * 100 for k in keys]
            se = [res[s][mode][k]["se"] * 100 for k in keys]
            ax.bar([j + i * w for j in range(len(keys))], acc, w, yerr=se, capsize=2, label=s.replace("_", " "))
        ax.set_xticks([j + w * (len(stages) - 1) / 2 for j in range(len(keys))], keys)
        ax.set_title(f"held-out accuracy, {mode} ({args_n(res)} problems each, +-1 SE)")
        ax.grid(axis="y", alpha=0.3)
    axes[0].set_ylabel("%")
    axes[1].legend(loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


def args_n(res: dict) -> int:
    return res["args"]["eval_problems"]


def timing(recs: list[dict], warm: int) -> dict:
    """Per-step means over the steps after the first ``warm`` (the carried population settles)."""
    rs = recs[warm:]
    n = len(rs)
    step_s = sum(r["step_s"] for r in rs) / n
    groups = sum(r["groups"] for r in rs) / n
    return {"step_s": step_s, "rollout_s": sum(r["rollout_s"] for r in rs) / n, "groups_per_step": groups,
            "s_per_group": step_s / groups, "carried": sum(r["carried"] for r in rs) / n,
            "staleness": sum(r["staleness"] for r in rs) / n, "reply_tokens": sum(r["length/max"] for r in rs) / n,
            "reply_p90": sum(r["length_p90/max"] for r in rs) / n, "reply_max": max(r["length_max/max"] for r in rs),
            "rollout_tokens": sum(r["rollout_tokens"] for r in rs) / n}


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="runs/post-demo")
    p.add_argument("--preset", default="tiny")
    p.add_argument("--device", default="cpu")
    p.add_argument("--tasks", default="arithmetic,sorting")
    p.add_argument("--difficulty", default="arithmetic=3,sorting=6", help="TASK=D,...: each task's difficulty")
    p.add_argument("--arith-ops", default="+-", help="arithmetic's operations (of + - *)")
    p.add_argument("--sorting-lengths", default="uniform", help="sorting's list lengths: uniform or long-tail")
    p.add_argument("--sorting-trace", default="selection", choices=SORTING_TRACES,
                   help="sorting's max-effort reasoning (k3/post/tasks/sorting.py)")
    p.add_argument("--sft-problems", type=int, default=1000, help="per task and effort")
    p.add_argument("--sft-steps", type=int, default=800)
    p.add_argument("--sft-init", default=None, help="fine-tune this checkpoint (and keep its tokenizer) instead of "
                   "training a new model")
    p.add_argument("--sft-batch", type=int, default=8)
    p.add_argument("--sft-seq-len", type=int, default=128)
    p.add_argument("--rl-steps", type=int, default=150)
    p.add_argument("--low-steps", type=int, default=None, help="steps of the low/high RL stage (default: --rl-steps)")
    p.add_argument("--mopd-steps", type=int, default=150)
    p.add_argument("--rl-lr", type=float, default=3e-4)
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=160)
    p.add_argument("--eval-problems", type=int, default=256)
    p.add_argument("--timing-steps", type=int, default=16)
    p.add_argument("--chunk", type=int, default=32, help="partial rollout's chunk in the timing runs")
    p.add_argument("--mopd-efforts", default="max", help="the efforts distilled: the teacher of (task, effort) is "
                   "RL effort's run (rl-max, or rl-low for low and high)")
    p.add_argument("--timing", default="full,partial,partial-keep", help="the timing runs: full (no partial "
                   "rollout), partial (carried replies re-encoded after each update), partial-keep (continued on "
                   "their kept cache: --no-reencode)")
    p.add_argument("--stages", default="sft,rl,low,mopd,partial")
    args = p.parse_args()
    stages = set(args.stages.split(","))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    difficulty = {k: int(v) for k, v in (kv.split("=") for kv in args.difficulty.split(",") if kv)}
    tasks = {n: dataclasses.replace(get_task(n), **({"difficulty": difficulty[n]} if n in difficulty else {}),
                                    **({"ops": tuple(args.arith_ops)} if n == "arithmetic" else {}),
                                    **({"lengths": args.sorting_lengths, "trace": args.sorting_trace} if n == "sorting" else {}))
             for n in args.tasks.split(",")}
    results = out / "results.json"
    res = json.loads(results.read_text()) if results.exists() else {}
    res["args"] = vars(args)
    t0 = time.time()

    def done(key, value):  # merged into what is on disk: stages may run in parallel processes
        res.update({**(json.loads(results.read_text()) if results.exists() else {}), "args": vars(args), key: value})
        results.write_text(json.dumps(res, indent=2) + "\n")
        print(key, json.dumps(value), flush=True)

    sft_ckpt = out / "sft" / "checkpoint"
    if "sft" in stages:
        lines = []
        for e in ("low", "high", "max"):
            f = write_sft_jsonl(out / f"sft-{e}.jsonl", list(tasks.values()), args.sft_problems, seed=0, effort=e)
            lines += f.read_text().splitlines()
        (out / "sft.jsonl").write_text("\n".join(lines) + "\n")
        cfg = TrainConfig(out=str(out / "sft"), preset=args.preset, chat=True, data=str(out / "sft.jsonl"),
                          vocab_size=512, init_from=args.sft_init, steps=args.sft_steps, batch_size=args.sft_batch, seq_len=args.sft_seq_len,
                          lr=3e-3, eval_every=args.sft_steps, log_every=10, save_every=args.sft_steps,
                          device=args.device)
        plan = ParallelPlan(ParallelDims(), resolve_device(args.device))
        train(cfg, plan, log=lambda *a: None, prepare=prepare)
        done("sft_s", time.time() - t0)
        done("sft", evaluate(sft_ckpt, tasks, args))
    if "rl" in stages:  # the max variant first: a loose budget
        t1 = time.time()
        ckpt, _ = rl(args, tasks, "rl-max", sft_ckpt, ("max",), args.rl_steps)
        done("rl_max_s", time.time() - t1)
        done("rl_max", evaluate(ckpt, tasks, args))
    if "low" in stages:  # then low and high from it, tau annealed from max's value to theirs
        t1 = time.time()
        ckpt, _ = rl(args, tasks, "rl-low", out / "rl-max" / "checkpoint", ("low", "high"),
                     args.low_steps or args.rl_steps,
                     tau_from=2.0)
        done("rl_low_s", time.time() - t1)
        done("rl_low", evaluate(ckpt, tasks, args))
    if "mopd" in stages:  # one student from SFT; the teacher of (task, effort) is that effort's RL run
        distilled = tuple(args.mopd_efforts.split(","))
        teachers = {f"{t}:{e}": str(out / f"rl-{'max' if e == 'max' else 'low'}" / "checkpoint") for t in tasks
                    for e in distilled}
        t1 = time.time()
        ckpt, _ = rl(args, tasks, "mopd", sft_ckpt, distilled, args.mopd_steps, teachers=teachers)
        done("mopd_s", time.time() - t1)
        done("mopd", evaluate(ckpt, tasks, args))
    if "partial" in stages:  # time per step from SFT at max effort, the same prompts, without and with
        runs = {"full": {"chunk": None}, "partial": {"chunk": args.chunk},
                "partial-keep": {"chunk": args.chunk, "reencode": False}}
        for name in args.timing.split(","):
            _, recs = rl(args, tasks, f"timing-{name}", sft_ckpt, ("max",), args.timing_steps, **runs[name])
            done(f"timing_{name}", timing(recs, warm=args.timing_steps // 4))
    if "eval" in stages:  # (re-)evaluate every checkpoint there is
        for key, name in (("sft", "sft"), ("rl_max", "rl-max"), ("rl_low", "rl-low"), ("mopd", "mopd")):
            if (out / name / "checkpoint").is_dir():
                done(key, evaluate(out / name / "checkpoint", tasks, args))
    if "sft" in res and "rl_max" in res:
        accuracy_figure(res, out / "accuracy.png")
    from k3.cli.plot import plot_run

    for name in ("rl-max", "rl-low", "mopd"):
        if (out / name / "metrics.jsonl").exists():
            plot_run(out / name)
    done("total_s", time.time() - t0)


if __name__ == "__main__":
    main()
