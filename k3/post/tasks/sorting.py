"""Sorting a list of integers: "Sort: 5 3 9 1 3" -> "1 3 3 5 9" (ascending).

``difficulty`` d: lists of 2..d numbers drawn from 0..``max_value`` (9 by default: one token per number under the
byte-level tokenizers). ``lengths``: how a list's length n is drawn from 2..d: "uniform" (each equally likely) or
"long-tail" (P(n) proportional to 1/n: most lists short, a few long; at d = 16 about 45% have 2-4 numbers and 8%
have 14-16, so the max-effort traces, whose length grows with n squared, run from ~10 to ~220 tokens: the reply
lengths of a batch have the long tail that partial rollout is for). The check compares the integers of the final
answer (spaces or commas between them).

Reasoning at "max", by ``trace``: "selection" (selection sort, one line per step, "take 1 from 5 3 9 1 3": the
smallest of what is left, found by comparing each; its length grows with the square of the length), "counting"
(counting sort: every value from 0 to ``max_value`` in order, each followed by its occurrences in the list or "-",
"0 : - 1 : 1 2 : - 3 : 3 3 ...": each step a count of one value, found by matching it in the prompt; the answer is
the occurrences in order) or "distinct" (high's sketch, then the distinct values in ascending order, "n = 5 , min
= 1 , max = 9" and "1 3 5 9": which numbers come in which order, without their counts; the final answer writes each
as often as the prompt has it); at "high" the length and the extremes; at "low" none. After SFT on the tiny preset
none of them makes max as accurate as low (benchmarks/RESULTS.md, which has the RL runs too).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from .base import Problem, Task, check_difficulty, check_effort, spaced

LENGTHS = ("uniform", "long-tail")
TRACES = ("selection", "counting", "distinct")


@dataclass(frozen=True)
class Sorting(Task):
    difficulty: int = 6
    max_value: int = 9
    lengths: str = "uniform"  # "uniform" | "long-tail": how a list's length is drawn (the module docstring)
    trace: str = "selection"  # one of TRACES: max effort's reasoning (the module docstring)
    name = "sorting"

    def __post_init__(self):
        check_difficulty(self.name, self.difficulty, 2, 64)
        if not isinstance(self.max_value, int) or self.max_value < 1:
            raise ValueError(f"sorting: max_value must be an integer >= 1; got {self.max_value!r}")
        if self.lengths not in LENGTHS:
            raise ValueError(f"sorting: lengths must be one of {LENGTHS}; got {self.lengths!r}")
        if self.trace not in TRACES:
            raise ValueError(f"sorting: trace must be one of {TRACES}; got {self.trace!r}")

    def sample(self, rng: random.Random) -> Problem:
        sizes = range(2, self.difficulty + 1)
        n = rng.randint(2, self.difficulty) if self.lengths == "uniform" else \
            rng.choices(sizes, weights=[1 / k for k in sizes])[0]
        xs = [rng.randint(0, self.max_value) for _ in range(n)]
        return Problem(self.name, f"Sort: {spaced(xs)}", spaced(sorted(xs)), {"xs": xs})

    def reference_reasoning(self, problem: Problem, effort: str = "max") -> str:
        xs = problem.meta["xs"]
        if check_effort(effort) == "low":
            return ""
        sketch = f"n = {len(xs)} , min = {min(xs)} , max = {max(xs)}"
        if effort == "high":
            return sketch
        if self.trace == "distinct":
            return f"{sketch}\n{spaced(sorted(set(xs)))}"
        if self.trace == "counting":
            return spaced(f"{v} : {spaced([v] * xs.count(v)) if v in xs else '-'}" for v in range(self.max_value + 1))
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
