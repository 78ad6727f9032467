"""Autonomous Execution Tasks (seed 000 §7.4): a goal, constraints, a tool action space, a budget and verifiers.

A task is generated from a seed (unlimited variants, nothing downloaded). Its verifiers judge the FINAL state of
the sandbox, never the agent's claims, and each runs in a fork of it, so judging has no side effects on the
episode: the public verifier gives diagnostic feedback (what a submission sees), the hidden verifier runs
held-out scenarios that the workspace never contains (the reward). An oracle (scripted actions) shows each
task solvable; a ``wrong`` solution (one that games the public checks) shows the hidden verifier is needed.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Callable

from ..base import SandboxBase


@dataclasses.dataclass(frozen=True)
class Budget:
    tokens: int = 60_000  # prompt + completion tokens over the episode, as the server reports them
    tool_calls: int = 40
    submissions: int = 3


@dataclasses.dataclass
class Verdict:
    passed: bool
    score: float  # fraction of checks passed
    feedback: str  # what failed, in words the agent can act on
    findings: list[str] = dataclasses.field(default_factory=list)  # hacking-detector rules that fired

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


# Actions an oracle takes, independent of the harness's tool schema (the harness renders them as tool calls).
@dataclasses.dataclass(frozen=True)
class Write:
    path: str
    content: str


@dataclasses.dataclass(frozen=True)
class Replace:
    path: str
    old: str
    new: str


@dataclasses.dataclass(frozen=True)
class Shell:
    cmd: str


@dataclasses.dataclass(frozen=True)
class Submit:
    pass


@dataclasses.dataclass
class Instance:
    """One generated task: the files the workspace starts with and how the final state is judged."""

    task: str
    seed: int
    goal: str
    files: dict[str, str]
    budget: Budget
    public: Callable[[SandboxBase], Verdict]
    hidden: Callable[[SandboxBase], Verdict]
    oracle: list  # actions
    wrong: list  # actions that pass the public verifier and fail the hidden one
    cheats: dict[str, list] = dataclasses.field(default_factory=dict)  # rule name -> actions that trip it


def in_fork(sandbox: SandboxBase, files: dict[str, str], cmd: str, timeout: float = 60):
    """Run ``cmd`` in a fork of ``sandbox`` with ``files`` added, so judging leaves the episode untouched."""
    f = sandbox.fork()
    try:
        for p, c in files.items():
            f.write(p, c)
        return f.exec(cmd, timeout=timeout)
    finally:
        f.close()


def check_cases(results_json: str, expected: list, labels: list[str]) -> tuple[int, list[str]]:
    """(passed count, failure lines) from a runner's JSON list of results."""
    try:
        got = json.loads(results_json.strip().splitlines()[-1])
    except (json.JSONDecodeError, IndexError):
        return 0, [f"the runner printed no results: {results_json[-300:]!r}"]
    fails = [f"{lab}: got {g!r}, expected {e!r}" for lab, g, e in zip(labels, got, expected) if g != e]
    if len(got) != len(expected):
        fails.append(f"{len(got)} results for {len(expected)} cases")
    return len(expected) - len(fails), fails


def verdict(passed: int, total: int, fails: list[str], findings: list[str] | None = None) -> Verdict:
    findings = findings or []
    ok = passed == total and not fails and not findings
    text = "all checks passed" if ok else "; ".join(findings + fails[:6])
    return Verdict(ok, passed / max(total, 1), text, findings)
