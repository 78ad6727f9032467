"""The RL loop of ``k3 rl`` and ``k3 distill`` (SPEC §9): rollouts -> rewards -> advantages -> one optimiser step.

Each step: ``prompts`` new prompt groups (a training-split problem of a task, an effort, G = ``samples`` replies)
join the trajectories carried over; every unfinished trajectory is rolled out by the current policy for up to
``chunk`` tokens (partial rollout; None = to the end), again until at least one group is complete. One engine
serves the run (``Rollout.load`` puts each step's weights in it; ``reencode=False`` keeps the carried replies'
cache across it instead of re-encoding them: faster, stale, and a resumed run re-encodes once). The complete groups are trained on, the rest
carry over (``Trajectory.versions`` records which policy drew each
token; the objective's ratio is against the recorded sampling log-prob, so older tokens are corrected).

Rewards: RL: the verifier's 1/0, or -1 for a reply longer than tau * b0(x) (k3.post.effort), then group-normalised
advantages, one per trajectory, given to each of its tokens. MOPD (``teachers``): the teacher of the group's
(domain, effort) scores every token; its clipped log-ratio to the sampling log-prob is the token's advantage.
The optimiser, schedule, QAT and memory options are ``k3 train``'s (``k3.train.trainer.Trainer``); checkpoints
hold the carried trajectories, the prompt cursor and the budget line, so a resumed run continues exactly.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..data import load_tokenizer
from ..train import data as run_data
from ..train.loop import TrainConfig
from ..train.metrics import MetricsLog
from ..train.plan import StepLoss, TrainingPlan
from ..train.state import check_resumable, find_checkpoint
from ..train.trainer import Trainer, build_model
from .batch import forward_logprobs, pack, score, token_logprobs
from .effort import DEFAULT_TAU, BudgetLine, fit_budget, tau_at
from .evaluate import ask, evaluate_policy
from .format import ChatFormat
from .tasks.base import check_effort
from .objective import budget_reward, group_advantages, mopd_token_rewards, policy_loss
from .rollout import ROLLOUT_DTYPES, Rollout, Trajectory

__all__ = ["RLConfig", "rl_train"]

BLOCK = 256  # training problems generated per task at a time


@dataclass(frozen=True)
class RLConfig:
    train: TrainConfig  # out, init_from (the SFT checkpoint), steps, lr and every optimiser/QAT/memory option
    tasks: tuple[str, ...] = ("arithmetic",)
    efforts: tuple[str, ...] = ("max",)
    samples: int = 8  # G replies per prompt
    prompts: int = 8  # new prompt groups per step
    max_tokens: int = 128  # longest reply
    chunk: int | None = None  # partial rollout: most tokens a trajectory writes per round (None: off)
    reencode: bool = True  # carried replies re-encoded by each new policy; False: continued on their cache
    eps_low: float = 0.2
    eps_high: float = 0.28  # DAPO's clip-higher: room for unlikely tokens to grow
    beta: float = 0.0  # KL-to-reference coefficient (0: reference-free)
    adv_scale: bool = True  # divide advantages by the group's std (GRPO); False: centring only (Dr. GRPO)
    taus: dict = field(default_factory=lambda: dict(DEFAULT_TAU))  # effort -> tau
    tau_from: float | None = None  # anneal each effort's tau from this value (the curriculum's max) down to its own
    anneal_frac: float = 0.5
    budget_prompts: int = 16  # per task: prompts whose reference replies fit b0
    micro_tokens: int = 4096  # packed tokens per micro-batch
    eval_every: int | None = None
    eval_problems: int = 32
    eval_temperature: float = 0.0
    teachers: dict = field(default_factory=dict)  # MOPD: "domain:effort" -> checkpoint directory
    r_max: float = 5.0  # MOPD's reward clip
    rollout_dtype: str = "auto"  # the engine's copy of the weights (k3.post.rollout.ROLLOUT_DTYPES; auto: bf16 on CUDA)

    def __post_init__(self):
        def need(ok, name, what):
            if not ok:
                raise ValueError(f"RLConfig.{name} {what}; got {getattr(self, name)!r}")

        for name in ("samples", "prompts", "max_tokens", "budget_prompts", "micro_tokens", "eval_problems"):
            need(getattr(self, name) >= 1, name, "must be >= 1")
        need(self.chunk is None or self.chunk >= 1, "chunk", "must be >= 1 (or None: no partial rollout)")
        need(0 < self.eps_low < 1 and self.eps_high > 0, "eps_low", "and eps_high must be in (0, 1) and > 0")
        need(self.beta >= 0 and self.r_max > 0, "beta", "must be >= 0 (and r_max > 0)")
        need(bool(self.tasks) and bool(self.efforts), "tasks", "and efforts must be non-empty")
        for e in self.efforts:
            check_effort(e)
        need(self.rollout_dtype in ROLLOUT_DTYPES, "rollout_dtype", f"must be one of {sorted(ROLLOUT_DTYPES)}")
        need(self.train.init_from is not None, "train", "needs init_from: RL starts from an SFT checkpoint")
        need(self.train.dp == self.train.cp == self.train.ep == 1, "train",
             "runs in one process: dp, cp and ep must be 1")

    def to_json(self) -> dict:
        return {**self.train.to_json(), "rl": {k: v for k, v in dataclasses.asdict(self).items() if k != "train"}}


def _seed(*parts: int) -> int:
    h = 0x9E3779B97F4A7C15
    for p in parts:
        h = (h * 0x100000001B3 ^ (p & 0xFFFFFFFFFFFF)) % (1 << 62)
    return h


class _Prompts:
    """Group g -> (task name, effort, problem): deterministic in g, so the cursor alone resumes the stream."""

    def __init__(self, cfg: RLConfig, tasks: dict):
        self.combos = [(t, e) for t in cfg.tasks for e in cfg.efforts]
        self.tasks, self.seed, self._blocks = tasks, cfg.train.seed, {}

    def __call__(self, g: int):
        name, effort = self.combos[g % len(self.combos)]
        k = g // len(self.combos)
        key = (name, k // BLOCK)
        if key not in self._blocks:
            self._blocks[key] = self.tasks[name].generate("train", BLOCK, _seed(self.seed, k // BLOCK))
        return name, effort, self._blocks[key][k % BLOCK]


def _calibrate(model, tok, fmt, cfg: RLConfig, tasks: dict) -> dict[str, BudgetLine]:
    """b0 per task from the reference model's replies at max effort (k3.post.effort)."""
    rollout = Rollout(model, tok, fmt.stop, cfg.max_tokens, version=0, dtype=cfg.rollout_dtype)
    lines = {}
    for name, task in tasks.items():
        problems = task.generate("train", cfg.budget_prompts, _seed(cfg.train.seed, 1 << 40))
        trajs = ask(rollout, fmt, problems, "max", _seed(cfg.train.seed, 2 << 40))
        lines[name] = fit_budget([len(t.prompt_ids) for t in trajs], [len(t.tokens) for t in trajs])
    return lines


def rl_train(cfg: RLConfig, plan: TrainingPlan, tasks: dict | None = None, log=print) -> dict:
    """Run (or resume) ``k3 rl`` / ``k3 distill`` under ``plan`` (one process: the caller builds
    ``k3.distributed.plan.ParallelPlan(ParallelDims(), device)``, as ``k3 rl`` does). ``tasks``: name -> task
    (default: k3.post.tasks')."""
    if plan.world != 1:
        raise ValueError(f"k3 rl / k3 distill run in one process; got a plan over {plan.world} processes (run it "
                         "without torchrun)")
    if tasks is None:
        from .tasks import get_task

        tasks = {name: get_task(name) for name in cfg.tasks}
    tcfg = cfg.train
    run, device = Path(tcfg.out), plan.device
    run.mkdir(parents=True, exist_ok=True)
    resume_from = find_checkpoint(run)
    if resume_from is not None:
        done, saved_steps = check_resumable(resume_from, cfg.to_json(), tcfg.verify)
        if done >= tcfg.steps:
            log(f"{run} is already complete at step {done} (--steps {tcfg.steps})")
            return {"step": done, "run": str(run), "already_complete": True}
    else:
        saved_steps = None
    init = run_data.init_dir(tcfg)
    if not (run / "tokenizer.json").exists():
        shutil.copyfile(init / "tokenizer.json", run / "tokenizer.json")
    tok = load_tokenizer(run / "tokenizer.json")
    fmt = ChatFormat(tok)
    from ..config import K3Config

    mcfg = K3Config.from_hf(init).replace(qat=tcfg.qat)
    torch.manual_seed(tcfg.seed)
    model, state = build_model(mcfg, device, resume_from, None if resume_from else init)
    reference = build_model(mcfg, device, None, init)[0].eval() if cfg.beta else None
    missing = [f"{t}:{e}" for t in cfg.tasks for e in cfg.efforts if cfg.teachers and f"{t}:{e}" not in cfg.teachers]
    if missing:
        raise ValueError(f"no teacher for {', '.join(missing)}: give one --teacher TASK:EFFORT=CHECKPOINT per (task, "
                         "effort) distilled")
    teachers = {}
    for key, path in cfg.teachers.items():
        from ..pretrained import load_pretrained

        teachers[key] = load_pretrained(path, dtype=torch.float32).to(device).eval()
    trainer = Trainer(tcfg, plan, model, state, saved_steps, log)
    rl_state = state["rl"] if state is not None else None
    if rl_state is None:
        lines = {} if teachers else _calibrate(model, tok, fmt, cfg, tasks)
        groups, next_group = {}, 0
    else:
        lines = {k: BudgetLine(*v) for k, v in rl_state["budget"].items()}
        next_group = rl_state["next_group"]
        from .tasks import Problem

        groups = {g["id"]: {**g, "problem": Problem(**g["problem"]), "trajs": [Trajectory(**t) for t in g["trajs"]]}
                  for g in rl_state["groups"]}
    if lines:
        log("budget b0(x) = a + b |x| per task: " + ", ".join(f"{k}: {v.a:.1f} + {v.b:.2f}|x|" for k, v in lines.items()))
    prompts = _Prompts(cfg, tasks)
    metrics = MetricsLog(run / "metrics.jsonl", truncate_after_step=trainer.step_count if state else None)
    (run / "run_info.json").write_text(json.dumps({"command": "distill" if teachers else "rl",
                                                   "rl_config": cfg.to_json()}, indent=2) + "\n")
    step, end = trainer.step_count, min(tcfg.steps, tcfg.stop_after or tcfg.steps)
    rollout = Rollout(model, tok, fmt.stop, cfg.max_tokens, version=step, dtype=cfg.rollout_dtype)  # one engine
    last, last_save = {}, time.time()
    while step < end:
        t0 = time.time()
        for _ in range(cfg.prompts):
            name, effort, problem = prompts(next_group)
            ids = fmt.prompt_ids([{"role": "user", "content": problem.prompt}], effort)
            groups[next_group] = {"id": next_group, "task": name, "effort": effort, "problem": problem,
                                  "budget": lines[name](len(ids)) if lines else None,
                                  "trajs": [Trajectory(next_group, ids, _seed(tcfg.seed, next_group, i))
                                            for i in range(cfg.samples)]}
            next_group += 1
        rollout.load(model, step, cfg.reencode)
        active = [t for g in groups.values() for t in g["trajs"]]
        drawn = rollout.round(active, cfg.chunk)
        while not any(all(t.done for t in g["trajs"]) for g in groups.values()):
            drawn += rollout.round(active, cfg.chunk)
        t_roll = time.time() - t0
        ready = [groups.pop(k) for k in [k for k, g in groups.items() if all(t.done for t in g["trajs"])]]
        stats = _rewards(cfg, ready, tasks, fmt, teachers, step)
        trajs = [t for g in ready for t in g["trajs"]]
        n_tok = sum(len(t.tokens) for t in trajs)
        batches = pack(trajs, [a for g in ready for a in g["adv"]], cfg.micro_tokens, 1.0)
        for b in batches:
            b["denom"] = max(n_tok, 1) / len(batches)  # the micro-batches' mean is the step's token mean
        clip = {"clipped": 0.0, "kl": 0.0}

        def loss_fn(m, b):
            logp, out = forward_logprobs(m, b, trainer.record)  # with what QK-clip and the balancer read
            ref = token_logprobs(reference, b).detach() if reference is not None else None
            loss, s = policy_loss(logp, b["sampled_logp"].to(logp.device), b["adv"].to(logp.device), cfg.eps_low,
                                  cfg.eps_high, b["denom"], ref, cfg.beta)
            for k in clip:
                clip[k] += s[k]
            return StepLoss(loss, loss.detach(), None, len(b["targets"]), out.max_logit, out.routing)

        rec = trainer.step(batches, loss_fn) if batches else {"step": step + 1}
        step = trainer.step_count = rec["step"]
        rec.update(stats, clip_frac=clip["clipped"] / max(n_tok, 1), kl=clip["kl"] / max(n_tok, 1),
                   groups=len(ready), carried=sum(1 for g in groups.values() for t in g["trajs"] if not t.done),
                   staleness=sum(step - 1 - v for t in trajs for v in t.versions) / max(n_tok, 1),
                   rollout_tokens=drawn, rollout_s=t_roll, step_s=time.time() - t0)
        if cfg.eval_every and (step % cfg.eval_every == 0 or step == tcfg.steps):
            for k, v in evaluate_policy(model, tok, tasks, cfg.efforts, cfg.eval_problems, cfg.max_tokens,
                                        cfg.eval_temperature, tcfg.seed, cfg.rollout_dtype).items():
                rec[f"eval_accuracy/{k}"], rec[f"eval_length/{k}"] = v["accuracy"], v["length"]
            model.train()
        metrics.write(rec)
        if step % tcfg.log_every == 0 or step == end:
            log(" ".join(f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}" for k, v in rec.items()
                         if k in ("step", "reward", "accuracy", "clip_frac", "groups", "carried", "step_s")
                         or k.startswith("eval_accuracy")))
        last = rec
        if tcfg.save_due(step, end, (time.time() - last_save) / 60):
            last_save = time.time()
            extra = {"rl": {"next_group": next_group, "budget": {k: [v.a, v.b] for k, v in lines.items()},
                            "groups": [{**g, "problem": dataclasses.asdict(g["problem"]),
                                        "trajs": [t.to_dict() for t in g["trajs"]]} for g in groups.values()]}}
            trainer.save(run, run / "tokenizer.json", extra, cfg.to_json())
    return {"step": step, "last": last, "run": str(run)}


def _rewards(cfg: RLConfig, ready: list[dict], tasks: dict, fmt: ChatFormat, teachers: dict, step: int) -> dict:
    """Set each ready group's "adv" (per trajectory, one per token); -> the step's reward metrics."""
    per_effort: dict[str, list] = {}
    rewards_all, correct_all, over = [], [], 0
    for g in ready:
        task, effort = tasks[g["task"]], g["effort"]
        correct = [float(task.verify(g["problem"], fmt.parse(t.text, effort)[1])) for t in g["trajs"]]
        if teachers:
            t_logp = score(teachers[f"{g['task']}:{effort}"], g["trajs"], cfg.micro_tokens)
            g["adv"] = [mopd_token_rewards(torch.tensor(tl), torch.tensor(t.logprobs), cfg.r_max).tolist()
                        for tl, t in zip(t_logp, g["trajs"])]
            rewards = [sum(a) / max(len(a), 1) for a in g["adv"]]
        else:
            tau = tau_at(step, cfg.train.steps, cfg.taus[effort], cfg.tau_from, cfg.anneal_frac)
            rewards = [budget_reward(c, len(t.tokens), g["budget"], tau) for c, t in zip(correct, g["trajs"])]
            over += sum(r == -1.0 for r in rewards)
            adv = group_advantages(torch.tensor([rewards]), scale=cfg.adv_scale)[0].tolist()
            g["adv"] = [[a] * len(t.tokens) for a, t in zip(adv, g["trajs"])]
        rewards_all += rewards
        correct_all += correct
        per_effort.setdefault(effort, []).extend(len(t.tokens) for t in g["trajs"])
    n = max(len(rewards_all), 1)
    out = {"reward": sum(rewards_all) / n, "accuracy": sum(correct_all) / n, "over_budget": over / n}
    for e, lens in per_effort.items():
        lens = sorted(lens)
        out[f"length/{e}"] = sum(lens) / len(lens)
        out[f"length_p90/{e}"], out[f"length_max/{e}"] = lens[int(0.9 * (len(lens) - 1))], lens[-1]
        if not teachers:
            out[f"tau/{e}"] = tau_at(step, cfg.train.steps, cfg.taus[e], cfg.tau_from, cfg.anneal_frac)
    return out
