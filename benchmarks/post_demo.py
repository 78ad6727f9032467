"""The post-training pipeline on CPU with the tiny preset (SPEC §9): SFT cold start -> RL (max effort, then low
with tau annealed from max's) -> MOPD of the RL teachers into one student; held-out accuracy and reply length at
each stage, and the time per RL step with and without partial rollout.

    python benchmarks/post_demo.py --out runs/post-demo            # ~minutes on a laptop CPU
    python benchmarks/post_demo.py --out runs/post-small --preset small --device cuda --sft-steps 2000 --rl-steps 200

Prints one JSON object of results (also written to OUT/results.json).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from k3.checkpoint import load_pretrained
from k3.data import load_tokenizer
from k3.post.evaluate import evaluate_policy
from k3.post.rl import RLConfig, rl_train
from k3.post.sft_data import prepare
from k3.post.tasks import get_task, write_sft_jsonl
from k3.train.loop import TrainConfig, train
from k3.train.metrics import read_metrics


def evaluate(ckpt, tasks, efforts, args):
    model = load_pretrained(ckpt, dtype=torch.float32).to(args.device)
    tok = load_tokenizer(Path(ckpt) / "tokenizer.json")
    return evaluate_policy(model, tok, tasks, efforts, args.eval_problems, args.max_tokens, args.eval_temperature)


def rl(args, name, init, efforts, steps, quiet, **kw):
    t = TrainConfig(out=str(Path(args.out) / name), init_from=str(init), steps=steps, lr=args.rl_lr, warmup_frac=0.0,
                    log_every=5, save_every=steps, mtp_weight=0.0, device=args.device, preset=args.preset)
    cfg = RLConfig(train=t, tasks=tuple(args.tasks), efforts=efforts, samples=args.samples, prompts=args.prompts,
                   max_tokens=args.max_tokens, **kw)
    rl_train(cfg, log=quiet)
    return Path(t.out) / "checkpoint", read_metrics(t.out)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="runs/post-demo")
    p.add_argument("--preset", default="tiny")
    p.add_argument("--device", default="cpu")
    p.add_argument("--tasks", default="arithmetic,sorting")
    p.add_argument("--sft-problems", type=int, default=400, help="per task and effort")
    p.add_argument("--sft-steps", type=int, default=200)
    p.add_argument("--sft-batch", type=int, default=8)
    p.add_argument("--sft-seq-len", type=int, default=128)
    p.add_argument("--rl-steps", type=int, default=20)
    p.add_argument("--rl-lr", type=float, default=3e-4)
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--eval-problems", type=int, default=64)
    p.add_argument("--eval-temperature", type=float, default=1.0)
    p.add_argument("--stages", default="sft,rl,low,mopd,partial")
    args = p.parse_args()
    args.tasks = args.tasks.split(",")
    stages = set(args.stages.split(","))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tasks = {n: get_task(n) for n in args.tasks}
    quiet = lambda *a: None  # noqa: E731
    res = {"args": vars(args)}
    t0 = time.time()

    sft_ckpt = out / "sft" / "checkpoint"
    if "sft" in stages:
        lines = []
        for e in ("low", "high", "max"):
            f = write_sft_jsonl(out / f"sft-{e}.jsonl", args.tasks, args.sft_problems, seed=0, effort=e)
            lines += f.read_text().splitlines()
        (out / "sft.jsonl").write_text("\n".join(lines) + "\n")
        cfg = TrainConfig(out=str(out / "sft"), preset=args.preset, chat=True, data=str(out / "sft.jsonl"),
                          vocab_size=512, steps=args.sft_steps, batch_size=args.sft_batch, seq_len=args.sft_seq_len,
                          lr=3e-3,
                          eval_every=args.sft_steps, log_every=10, save_every=args.sft_steps, device=args.device)
        train(cfg, log=quiet, prepare=prepare)
        res["sft_s"] = time.time() - t0
    res["sft"] = evaluate(sft_ckpt, tasks, ("low", "max"), args)
    print(json.dumps(res["sft"]), flush=True)

    if "rl" in stages:  # the max variant first: a loose budget
        t1 = time.time()
        max_ckpt, recs = rl(args, "rl-max", sft_ckpt, ("max",), args.rl_steps, quiet)
        res["rl_max_s"] = time.time() - t1
        res["rl_max"] = evaluate(max_ckpt, tasks, ("low", "max"), args)
        res["rl_max_step_s"] = sum(r["step_s"] for r in recs) / len(recs)
        print(json.dumps(res["rl_max"]), flush=True)
    if "low" in stages:  # then low from it, tau annealed from max's value to low's
        low_ckpt, _ = rl(args, "rl-low", out / "rl-max" / "checkpoint", ("low",), args.rl_steps, quiet, tau_from=2.0)
        res["rl_low"] = evaluate(low_ckpt, tasks, ("low", "max"), args)
        print(json.dumps(res["rl_low"]), flush=True)
    if "mopd" in stages:  # one student (from SFT) from the teachers of each (task, effort) trained above
        efforts = tuple(e for e in ("low", "max") if (out / f"rl-{e}" / "checkpoint").is_dir())
        teachers = {f"{t}:{e}": str(out / f"rl-{e}" / "checkpoint") for t in args.tasks for e in efforts}
        st_ckpt, _ = rl(args, "mopd", sft_ckpt, efforts, args.rl_steps, quiet, teachers=teachers)
        res["mopd"] = evaluate(st_ckpt, tasks, ("low", "max"), args)
        print(json.dumps(res["mopd"]), flush=True)
    if "partial" in stages:  # time per step, same prompts, without and with partial rollout
        for name, chunk in (("full", None), ("partial", max(4, args.max_tokens // 4))):
            _, recs = rl(args, f"timing-{name}", sft_ckpt, ("max",), 6, quiet, chunk=chunk)
            res[f"step_s_{name}"] = sum(r["step_s"] for r in recs[1:]) / len(recs[1:])
            res[f"trained_groups_{name}"] = sum(r["groups"] for r in recs[1:]) / len(recs[1:])
    res["total_s"] = time.time() - t0
    (out / "results.json").write_text(json.dumps(res, indent=2) + "\n")
    print(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
