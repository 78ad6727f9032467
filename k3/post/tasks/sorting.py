"""Sorting a list of integers: "Sort: 5 3 9 1 3" -> "1 3 3 5 9" (ascending).

``difficulty`` d: lists of 2..d numbers drawn from 0..``max_value`` (9 by default: one token per number under the
byte-level tokenizers). The check compares the integers of the final answer (spaces or commas between them).

Reasoning at "max": selection sort, one line per step ("take 1 from 5 3 9 1 3": the smallest of what is left, found
by comparing each), so its length grows with the square of the length; at "high" the length and the extremes; at
"low" none.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from .base import Problem, Task, check_difficulty, check_effort, spaced


@dataclass(frozen=True)
class Sorting(Task):
    difficulty: int = 6
    max_value: int = 9
    name = "sorting"

    def __post_init__(self):
        check_difficulty(self.name, self.difficulty, 2, 64)
        if not isinstance(self.max_value, int) or self.max_value < 1:
            raise ValueError(f"sorting: max_value must be an integer >= 1; got {self.max_value!r}")

    def sample(self, rng: random.Random) -> Problem:
        xs = [rng.randint(0, self.max_value) for _ in range(rng.randint(2, self.difficulty))]
        return Problem(self.name, f"Sort: {spaced(xs)}", spaced(sorted(xs)), {"xs": xs})

    def reference_reasoning(self, problem: Problem, effort: str = "max") -> str:
        xs = problem.meta["xs"]
        if check_effort(effort) == "low":
            return ""
        if effort == "high":
            return f"n = {len(xs)} , min = {min(xs)} , max = {max(xs)}"
        rest, lines = list(xs), []
        while len(rest) > 1:
            m = min(rest)
            lines.append(f"take {m} from {spaced(rest)}")
            rest.remove(m)
        return "\n".join(lines + [f"last {rest[0]}"])

    def check(self, problem: Problem, answer: str) -> bool:
        try:
            got = [int(t) for t in answer.replace(",", " ").split()]
        except ValueError:
            return False
        return got == sorted(problem.meta["xs"])
