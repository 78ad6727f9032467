"""Bracket balancing: "Close the brackets: ( [ { ( ) [" -> "] } ] )", the shortest completion that balances.

Reasoning: at max effort the stack of open brackets after every symbol ("( -> ( [" ...); at high effort the
brackets still open at the end ("open: ( [ { ["); at low effort none.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from .base import Problem, Solution, check_effort

PAIRS = {"(": ")", "[": "]", "{": "}"}


def open_stack(symbols: list[str]) -> list[list[str]]:
    """The stack of open brackets after each symbol."""
    stack, out = [], []
    for s in symbols:
        if s in PAIRS:
            stack.append(s)
        else:
            stack.pop()
        out.append(list(stack))
    return out


@dataclass(frozen=True)
class Brackets:
    min_len: int = 4
    max_len: int = 10
    name: str = "brackets"

    def problem(self, rng: random.Random) -> Problem:
        n = rng.randint(self.min_len, self.max_len)
        symbols, stack = [], []
        while len(symbols) < n:
            if stack and rng.random() < 0.4:  # close the innermost
                symbols.append(PAIRS[stack.pop()])
            else:
                stack.append(rng.choice(list(PAIRS)))
                symbols.append(stack[-1])
        if not stack:  # something must be left to close
            stack.append(rng.choice(list(PAIRS)))
            symbols.append(stack[-1])
        text = " ".join(symbols)
        return Problem(self.name, f"Close the brackets: {text}", " ".join(PAIRS[s] for s in reversed(stack)), text,
                       {"symbols": symbols})

    def solution(self, problem: Problem, effort: str) -> Solution:
        symbols = problem.data["symbols"]
        stacks = open_stack(symbols)
        reasoning = {"low": "", "high": "open: " + " ".join(stacks[-1]),
                     "max": "\n".join(f"{s} -> {' '.join(st) or '.'}" for s, st in zip(symbols, stacks))}
        return Solution(reasoning[check_effort(effort)], problem.answer)

    def verify(self, problem: Problem, answer: str) -> bool:
        return answer.split() == problem.answer.split()
