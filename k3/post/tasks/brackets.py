"""Bracket balancing, two kinds of question over ( ) [ ] { }:

- "Close: ( [ { ( ) [" -> "] } ] )": the closing brackets that balance the sequence (the only shortest ones);
- "Balanced? ( [ ) ]" -> "no": whether the sequence is balanced ("yes" or "no").

``difficulty`` d: sequences of up to d symbols (at least 2). The check compares the closing brackets with spaces
ignored, or the first word of the answer (any case, a final "." ignored) with yes / no.

Reasoning at "max": the stack of open brackets after every symbol ("[ -> ( [", "! ) -> no" where a closer does
not match); at "high" what is left open at the end (or the first mismatch); at "low" none.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from .base import Problem, Task, check_difficulty, check_effort, first_word, spaced, unspace

PAIRS = {"(": ")", "[": "]", "{": "}"}
CLOSERS = {v: k for k, v in PAIRS.items()}


def trace(symbols: list[str]) -> tuple[list[list[str]], int | None]:
    """(the stack of open brackets after each symbol up to the first mismatch, the mismatch's index or None)."""
    stack, out = [], []
    for i, s in enumerate(symbols):
        if s in PAIRS:
            stack.append(s)
        elif stack and stack[-1] == CLOSERS[s]:
            stack.pop()
        else:
            return out, i
        out.append(list(stack))
    return out, None


def _random_prefix(rng: random.Random, n: int) -> list[str]:
    symbols, stack = [], []
    while len(symbols) < n:
        if stack and rng.random() < 0.45:
            symbols.append(PAIRS[stack.pop()])
        else:
            stack.append(rng.choice(list(PAIRS)))
            symbols.append(stack[-1])
    return symbols


@dataclass(frozen=True)
class Brackets(Task):
    difficulty: int = 8
    name = "brackets"

    def __post_init__(self):
        check_difficulty(self.name, self.difficulty, 2, 256)

    def sample(self, rng: random.Random) -> Problem:
        if rng.random() < 0.5:  # close the open brackets of a prefix that leaves some open
            symbols = _random_prefix(rng, rng.randint(1, self.difficulty - 1))
            stacks, _ = trace(symbols)
            if not stacks[-1]:
                symbols.append(rng.choice(list(PAIRS)))
                stacks, _ = trace(symbols)
            answer = spaced(PAIRS[s] for s in reversed(stacks[-1]))
            return Problem(self.name, f"Close: {spaced(symbols)}", answer, {"kind": "close", "symbols": symbols})
        symbols = _random_prefix(rng, rng.randint(1, self.difficulty // 2))  # then closed: a balanced sequence
        symbols += [PAIRS[s] for s in reversed(trace(symbols)[0][-1])]
        if rng.random() < 0.5:  # one symbol changed: usually unbalanced, the trace decides
            i = rng.randrange(len(symbols))
            symbols[i] = rng.choice([s for s in (*PAIRS, *CLOSERS) if s != symbols[i]])
        stacks, bad = trace(symbols)
        balanced = bad is None and not stacks[-1]
        return Problem(self.name, f"Balanced? {spaced(symbols)}", "yes" if balanced else "no",
                       {"kind": "balanced", "symbols": symbols})

    def reference_reasoning(self, problem: Problem, effort: str = "max") -> str:
        if check_effort(effort) == "low":
            return ""
        symbols = problem.meta["symbols"]
        stacks, bad = trace(symbols)
        if effort == "high":
            if bad is not None:
                return f"{symbols[bad]} at {bad + 1} does not close"
            return "open: " + (spaced(stacks[-1]) or "none")
        lines = [f"{s} -> {spaced(st) or '.'}" for s, st in zip(symbols, stacks)]
        if bad is not None:
            lines.append(f"! {symbols[bad]} -> no")
        return "\n".join(lines)

    def check(self, problem: Problem, answer: str) -> bool:
        if problem.meta["kind"] == "close":
            return unspace(answer) == unspace(problem.answer)
        return first_word(answer) == problem.answer
