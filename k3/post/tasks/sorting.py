"""Sorting digits: "Sort 5 3 9 1 3." -> "1 3 3 5 9".

Reasoning: at max effort the count of every digit 0-9 ("0:0 1:1 2:0 3:2 ..."); at high effort the length and the
extremes ("n=5 min=1 max=9"); at low effort none.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from .base import Problem, Solution, check_effort, spaced


@dataclass(frozen=True)
class Sorting:
    min_len: int = 4
    max_len: int = 8
    name: str = "sorting"

    def problem(self, rng: random.Random) -> Problem:
        xs = [rng.randrange(10) for _ in range(rng.randint(self.min_len, self.max_len))]
        return Problem(self.name, f"Sort {spaced(xs)}.", spaced(sorted(xs)), spaced(xs), {"xs": xs})

    def solution(self, problem: Problem, effort: str) -> Solution:
        xs = problem.data["xs"]
        reasoning = {"low": "", "high": f"n={len(xs)} min={min(xs)} max={max(xs)}",
                     "max": " ".join(f"{d}:{xs.count(d)}" for d in range(10))}[check_effort(effort)]
        return Solution(reasoning, problem.answer)

    def verify(self, problem: Problem, answer: str) -> bool:
        return answer.split() == [str(x) for x in sorted(problem.data["xs"])]
