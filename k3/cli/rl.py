"""k3 rl: reasoning-effort RL on the embedded verifiable tasks from an SFT checkpoint (SPEC §9; k3.post.rl).

Rollouts through k3's engine, group-normalised advantages, the token-level clipped objective, the effort budget
(-1 over tau * b0(x)), partial rollout (--chunk), KL or reference-free (--beta), checkpoints and metrics.
The optimiser, QAT and memory options are ``k3 train``'s.
"""

from __future__ import annotations

import argparse
import dataclasses

from ..train.loop import TrainConfig
from .common import add_model_arguments, number, positive_int
from .train import add_train_arguments, config_from_args

HELP = "reinforcement learning with verifiable rewards and reasoning-effort budgets, from an SFT checkpoint"

RL = TrainConfig(out=None, steps=50, lr=1e-4, warmup_frac=0.0, log_every=1, save_every=10, eval_every=10,
                 balance="quantile", mtp_weight=0.0)


def _csv(s: str) -> tuple[str, ...]:
    return tuple(x.strip() for x in s.split(",") if x.strip())


def add_rl_arguments(p, distill: bool = False) -> None:
    add_model_arguments(p, default_preset="tiny")
    add_train_arguments(p, RL)
    for action in p._actions:
        if action.dest == "init_from":
            action.required, action.help = True, "the SFT checkpoint to start from (its tokenizer and chat format)"
    p.add_argument("--tasks", type=_csv, default=("arithmetic",), help="comma-separated embedded tasks "
                   "(arithmetic, sorting, brackets, parity, python)")
    p.add_argument("--efforts", type=_csv, default=("max",), help="comma-separated reasoning efforts (low, high, max)")
    p.add_argument("--samples", type=positive_int, default=8, help="replies per prompt (the group of advantages)")
    p.add_argument("--prompts", type=positive_int, default=8, help="new prompts per step")
    p.add_argument("--max-tokens", type=positive_int, default=128, help="longest reply")
    p.add_argument("--chunk", type=positive_int, default=None, help="partial rollout: most tokens a reply writes "
                   "per round; unfinished replies continue in the next step (default: off)")
    p.add_argument("--reencode", action=argparse.BooleanOptionalAction, default=True, help="partial rollout: "
                   "re-encode the carried replies with each step's new weights (default); --no-reencode continues "
                   "them on the cache their earlier tokens were drawn with (faster, stale)")
    p.add_argument("--eps-low", type=number(0, lo_open=True), default=0.2, help="ratio clip below: 1 - eps")
    p.add_argument("--eps-high", type=number(0, lo_open=True), default=0.28, help="ratio clip above: 1 + eps")
    p.add_argument("--beta", type=number(0), default=0.0, help="KL-to-reference coefficient (0: reference-free)")
    p.add_argument("--eval-problems", type=positive_int, default=32, help="held-out problems per task and effort")
    p.add_argument("--micro-tokens", type=positive_int, default=4096, help="packed tokens per micro-batch")
    from ..post.rollout import ROLLOUT_DTYPES

    p.add_argument("--rollout-dtype", choices=sorted(ROLLOUT_DTYPES), default="auto",
                   help="the rollout engine's copy of the weights; auto: bfloat16 on CUDA (CUDA graphs; its "
                        "log-probs, recorded at sampling, then differ from the fp32 policy's by rounding), else "
                        "the policy's dtype")
    if distill:
        p.add_argument("--teacher", action="append", default=[], metavar="TASK:EFFORT=CHECKPOINT", required=True,
                       help="a teacher per (task, effort), e.g. arithmetic:max=runs/rl-max/checkpoint")
        p.add_argument("--r-max", type=number(0, lo_open=True), default=5.0, help="the per-token reward clip")
    else:
        p.add_argument("--tau", default=None, help="per-effort budget multiples, e.g. 'max=2,high=1,low=0.5' "
                       "(defaults for efforts not named)")
        p.add_argument("--tau-from", type=number(0, lo_open=True), default=None, help="anneal tau from this value "
                       "(the max variant's) down to each effort's over the first --anneal-frac of the steps")
        p.add_argument("--anneal-frac", type=number(0), default=0.5)
        p.add_argument("--budget-prompts", type=positive_int, default=16, help="prompts per task whose SFT-model "
                       "replies fit the budget line b0")


def add_arguments(p) -> None:
    add_rl_arguments(p)


def rl_config(args, distill: bool = False):
    from ..post.effort import parse_taus
    from ..post.rl import RLConfig

    train = dataclasses.replace(config_from_args(args, RL), eval_every=args.eval_every)
    extra = {}
    if distill:
        teachers = {}
        for spec in args.teacher:
            key, sep, path = spec.partition("=")
            if not sep or key.count(":") != 1:
                raise ValueError(f"--teacher {spec!r}: write TASK:EFFORT=CHECKPOINT, e.g. arithmetic:max=runs/x")
            teachers[key] = path
        extra = {"teachers": teachers, "r_max": args.r_max}
    else:
        extra = {"taus": parse_taus(args.tau), "tau_from": args.tau_from, "anneal_frac": args.anneal_frac,
                 "budget_prompts": args.budget_prompts}
    return RLConfig(train=train, tasks=args.tasks, efforts=args.efforts, samples=args.samples, prompts=args.prompts,
                    max_tokens=args.max_tokens, chunk=args.chunk, reencode=args.reencode, eps_low=args.eps_low,
                    eps_high=args.eps_high, beta=args.beta, eval_every=args.eval_every,
                    eval_problems=args.eval_problems, micro_tokens=args.micro_tokens,
                    rollout_dtype=args.rollout_dtype, **extra)


def run(args, distill: bool = False) -> int:
    from ..distributed.plan import ParallelDims, ParallelPlan
    from ..post.rl import rl_train
    from ..train.loop import resolve_device

    cfg = rl_config(args, distill)
    plan = ParallelPlan(ParallelDims(), resolve_device(cfg.train.device))
    try:
        result = rl_train(cfg, plan)
    finally:
        plan.close()
    if not result.get("already_complete"):
        print(f"done: step {result['step']}; checkpoint in {result['run']}/checkpoint, metrics in "
              f"{result['run']}/metrics.jsonl (k3 plot {result['run']})")
    return 0
