"""What a verifiable task is (SPEC §9): problems from a seeded generator, a held-out split, worked solutions at
three reasoning efforts, and a verifier that is a plain Python function.

A ``Problem`` is plain data. ``Task.problem(rng)`` draws one; its split is decided by a stable hash of its
``key`` (the canonical statement), so the held-out problems are never trained on, whatever the seed or the order
of generation (``problems(task, split, n, seed)``). ``Task.solution(problem, effort)`` is the reference reply
(reasoning, answer) at effort "low" (answer only), "high" (a compact sketch) or "max" (every step), used for the
SFT cold start and for the token budget b0. ``Task.verify(problem, answer) -> bool`` checks a reply's final
answer (the text after the reasoning).
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Protocol

EFFORTS = ("low", "high", "max")
SPLITS = ("train", "test")
TEST_FRACTION = 0.1  # of all problems (by the hash of their statement): the held-out split


@dataclass(frozen=True)
class Problem:
    domain: str  # the task's name
    prompt: str  # the user's message
    answer: str  # the reference final answer
    key: str  # the canonical statement: decides the split; equal keys are the same problem
    data: dict = field(default_factory=dict, compare=False)  # what the verifier needs beyond the answer

    @property
    def split(self) -> str:
        return split_of(self.domain, self.key)


@dataclass(frozen=True)
class Solution:
    reasoning: str  # "" at low effort
    answer: str


class Task(Protocol):
    name: str

    def problem(self, rng: random.Random) -> Problem: ...

    def solution(self, problem: Problem, effort: str) -> Solution: ...

    def verify(self, problem: Problem, answer: str) -> bool: ...


def split_of(domain: str, key: str) -> str:
    """"test" for TEST_FRACTION of all statements (a stable hash of domain and key), else "train"."""
    h = int.from_bytes(hashlib.blake2b(f"{domain}\x00{key}".encode(), digest_size=8).digest(), "big")
    return "test" if h < TEST_FRACTION * 2**64 else "train"


def problems(task: Task, split: str, n: int, seed: int = 0) -> list[Problem]:
    """The first ``n`` distinct problems of ``split`` drawn by a generator seeded with ``seed`` (an evaluation set)."""
    out, seen = [], set()
    for i, p in enumerate(stream(task, split, seed)):
        if p.key not in seen:
            seen.add(p.key)
            out.append(p)
        if len(out) == n:
            return out
        if i > 1000 * n:
            raise ValueError(f"the task {task.name!r} has fewer than {n} distinct {split} problems; ask for fewer")
    raise AssertionError("unreachable")


def stream(task: Task, split: str, seed: int = 0, start: int = 0) -> Iterator[Problem]:
    """Endless problems of ``split``, drawn with replacement by a generator seeded with ``seed``; ``start`` skips
    that many first (a resumed run's cursor)."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}; got {split!r}")
    rng = random.Random(f"{task.name}:{seed}")
    emitted = 0
    while True:
        p = task.problem(rng)
        if p.split != split:
            continue
        if emitted >= start:
            yield p
        emitted += 1


def check_effort(effort: str) -> str:
    if effort not in EFFORTS:
        raise ValueError(f"effort must be one of {EFFORTS}; got {effort!r}")
    return effort


def spaced(digits) -> str:
    """Numbers written digit by digit ("4 0 7"): every digit is one token under any byte-level BPE."""
    return " ".join(str(d) for d in digits)


def unspace(text: str) -> str:
    return "".join(text.split())
