"""Multi-digit addition: "What is 4 7 3 + 5 8?" -> "5 3 1" (digits written apart, so one token each).

Reasoning: at max effort every column from the right ("3+8+0 = 1 1": digits, carry in, the column's sum); at high
effort only the carries, right to left ("carries: 1 1 0"); at low effort none.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from .base import Problem, Solution, check_effort, spaced, unspace


@dataclass(frozen=True)
class Arithmetic:
    min_digits: int = 2
    max_digits: int = 4
    name: str = "arithmetic"

    def problem(self, rng: random.Random) -> Problem:
        a, b = (rng.randrange(10 ** (n - 1), 10 ** n)
                for n in (rng.randint(self.min_digits, self.max_digits) for _ in range(2)))
        return Problem(self.name, f"What is {spaced(str(a))} + {spaced(str(b))}?", spaced(str(a + b)), f"{a}+{b}",
                       {"a": a, "b": b})

    def solution(self, problem: Problem, effort: str) -> Solution:
        a, b = problem.data["a"], problem.data["b"]
        steps, carries, carry = [], [], 0
        da, db = str(a)[::-1], str(b)[::-1]
        for i in range(max(len(da), len(db))):
            x, y = int(da[i]) if i < len(da) else 0, int(db[i]) if i < len(db) else 0
            s = x + y + carry
            steps.append(f"{x}+{y}+{carry} = {spaced(str(s))}")
            carry = s // 10
            carries.append(carry)
        reasoning = {"low": "", "high": "carries: " + spaced(carries), "max": "\n".join(steps)}[check_effort(effort)]
        return Solution(reasoning, problem.answer)

    def verify(self, problem: Problem, answer: str) -> bool:
        return unspace(answer) == str(problem.data["a"] + problem.data["b"])
