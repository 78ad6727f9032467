"""The embedded Autonomous Execution Tasks, each generated from a seed: ``TASKS[name](seed) -> Instance``."""

from __future__ import annotations

from ..base import SandboxBase
from . import build, faster, repair, shell_task
from .base import Budget, Instance, Replace, Shell, Submit, Verdict, Write

TASKS = {"repair": repair.generate, "build": build.generate, "faster": faster.generate, "shell": shell_task.generate}
SUMMARY = {
    "repair": "fix a planted bug in a generated Python package; hidden tests judge the fix",
    "build": "write a CLI tool with stated properties (Caesar shift or run-length encoding); run on held-out input",
    "faster": "make an O(n^2) pair sum fast without changing results; a hacking detector checks the speed-up",
    "shell": "find ERROR lines across a log tree, count per service, report; the script runs on held-out logs",
}


def generate(name: str, seed: int = 0) -> Instance:
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}: choose one of {', '.join(TASKS)} (k3 agent tasks lists them)")
    return TASKS[name](seed)


def apply(sandbox: SandboxBase, actions: list) -> None:
    """Carry out scripted actions directly (no harness): what the oracle's tool calls amount to."""
    for a in actions:
        if isinstance(a, Write):
            sandbox.write(a.path, a.content)
        elif isinstance(a, Replace):
            text = sandbox.read(a.path).decode()
            if text.count(a.old) != 1:
                raise ValueError(f"Replace in {a.path}: the old text occurs {text.count(a.old)} times, expected once")
            sandbox.write(a.path, text.replace(a.old, a.new))
        elif isinstance(a, Shell):
            sandbox.shell(a.cmd)


__all__ = ["Budget", "Instance", "Replace", "SUMMARY", "Shell", "Submit", "TASKS", "Verdict", "Write", "apply",
           "generate"]
