"""k3 agent: autonomous-execution episodes in a sandbox against an OpenAI-compatible endpoint (k3.env, issue 45).

``k3 agent tasks`` lists the embedded tasks; ``k3 agent run --task NAME --url URL`` runs episodes (``--url
oracle`` runs the task's scripted oracle through the same harness). Each episode's trajectory is one JSONL file
(one event a line: the episode, each assistant turn, each tool call, the result); the verifiers' verdicts and
the budget use are printed.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from .common import int_at_least

HELP = "run agent episodes on the embedded sandboxed tasks (tasks, run)"


def add_arguments(p) -> None:
    sub = p.add_subparsers(dest="agent_command", metavar="ACTION", required=True)
    sub.add_parser("tasks", help="list the embedded tasks", description="list the embedded tasks")
    r = sub.add_parser("run", help="run episodes", description="run episodes of one task")
    r.add_argument("--task", required=True, help="a task name (k3 agent tasks lists them)")
    r.add_argument("--url", required=True, help="an OpenAI-compatible server, e.g. http://127.0.0.1:8000/v1; "
                   "'oracle' runs the task's scripted oracle")
    r.add_argument("--harness", default="edit", help="a harness configuration: edit, patch, or a JSON file")
    r.add_argument("--seed", type=int, default=0, help="the task variant (episode i uses seed + i)")
    r.add_argument("--episodes", type=int_at_least(1), default=1)
    r.add_argument("--model", default=None, help="the model name to request (default: the server's first)")
    r.add_argument("--max-turns", type=int_at_least(1), default=None, help="override the harness's max_turns")
    r.add_argument("--max-tokens", type=int_at_least(1), default=None,
                   help="override the harness's tokens per turn")
    r.add_argument("--out", default="runs/agent", help="directory for trajectories (JSONL) and memory.md")
    r.add_argument("--backend", choices=["local", "docker"], default="local",
                   help="local: bubblewrap + overlayfs + cgroups; docker: a container per episode (needs a daemon)")


def _tasks() -> int:
    from ..env.tasks import SUMMARY, generate

    for name, text in SUMMARY.items():
        b = generate(name, 0).budget
        print(f"{name:8s} {text} (budget: {b.tokens} tokens, {b.tool_calls} tool calls, {b.submissions} "
              "submissions)")
    return 0


def _sandbox(backend: str, files):
    if backend == "docker":
        from ..env.docker import DockerSandbox, available

        ok, why = available()
        if not ok:
            raise RuntimeError(f"--backend docker: {why}; use --backend local")
        return DockerSandbox.create(files)
    from ..env import Sandbox

    return Sandbox.create(files)


def run(args) -> int:
    if args.agent_command == "tasks":
        return _tasks()
    import dataclasses

    from ..env.harness import Harness, HarnessConfig
    from ..env.policy import OpenAIPolicy, oracle
    from ..env.tasks import generate

    cfg = HarnessConfig.load(args.harness)
    over = {k: v for k, v in (("max_turns", args.max_turns), ("max_tokens_per_turn", args.max_tokens)) if v}
    cfg = dataclasses.replace(cfg, **over)
    model = None if args.url == "oracle" else OpenAIPolicy(args.url, args.model)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    passed = 0
    for i in range(args.episodes):
        inst = generate(args.task, args.seed + i)
        policy = model or oracle(inst, cfg.tools)
        path = out / f"{args.task}-s{inst.seed}-{cfg.name}-{time.strftime('%Y%m%d-%H%M%S')}.jsonl"
        with open(path, "w") as f, _sandbox(args.backend, inst.files) as sb:
            ep = Harness(cfg, policy, out / "memory.md").run(inst, sb, lambda e: f.write(json.dumps(e) + "\n"))
        passed += ep.hidden.passed
        pub = "not submitted" if ep.public is None else ("passed" if ep.public.passed else "failed")
        used = ", ".join(f"{k} {v}/{b}" for k, (v, b) in ep.used.items() if b is not None)
        total = ep.paused_s + ep.active_s
        print(f"{args.task} seed {inst.seed} [{cfg.name}]: public {pub}, hidden "
              f"{'passed' if ep.hidden.passed else 'failed'} (score {ep.hidden.score:.2f}); used {used}; "
              f"stop: {ep.stop}; sandbox paused {ep.paused_s:.2f} s of {total:.2f} s"
              + (f"; violations: {','.join(ep.violations)}" if ep.violations else ""))
        if not ep.hidden.passed:
            print(f"  hidden verifier: {ep.hidden.feedback[:300]}")
        print(f"  trajectory: {path}")
    print(f"{passed}/{args.episodes} episodes passed the hidden verifier")
    return 0
