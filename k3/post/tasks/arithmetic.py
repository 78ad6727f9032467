"""Multi-digit arithmetic: "What is 4 7 3 + 5 8?" -> "5 3 1" (digits written apart, so one token each).

``difficulty`` d: the operands of + and - have 1..d digits (a - b with a >= b: answers are never negative); for
* the first has 1..d digits and the second 1..ceil(d/2). ``ops`` picks the operations. The check compares the
digits of the final answer, spaces and commas ignored ("531", "5 3 1" and "5,3,1" are all right).

Reasoning at "max": every column from the right with its carry (+) or borrow (-), or one partial product per
digit of the multiplier and their sum (*); at "high" only the carries / borrows / partial products; at "low" none.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from .base import Problem, Task, check_difficulty, check_effort, spaced

OPS = ("+", "-", "*")


def _digits(n: int) -> str:
    return spaced(str(n))


def _columns(a: int, b: int, op: str) -> list[tuple[int, int, int, int, int]]:
    """(x, y, carry or borrow in, result digit, out) per column of a + b or a - b (a >= b), from the right."""
    da, db = str(a)[::-1], str(b)[::-1]
    cols, c = [], 0
    for i in range(max(len(da), len(db))):
        x, y = int(da[i]) if i < len(da) else 0, int(db[i]) if i < len(db) else 0
        s = x + y + c if op == "+" else x - y - c
        out = (s // 10) if op == "+" else int(s < 0)
        cols.append((x, y, c, s % 10, out))
        c = out
    return cols


@dataclass(frozen=True)
class Arithmetic(Task):
    difficulty: int = 2
    ops: tuple[str, ...] = OPS
    name = "arithmetic"

    def __post_init__(self):
        check_difficulty(self.name, self.difficulty, 1, 12)
        if not self.ops or any(o not in OPS for o in self.ops):
            raise ValueError(f"arithmetic: ops must be a non-empty subset of {OPS}; got {self.ops!r}")

    def sample(self, rng: random.Random) -> Problem:
        op = rng.choice(self.ops)
        nb = self.difficulty if op != "*" else (self.difficulty + 1) // 2
        a, b = (rng.randrange(10 ** (k - 1) if k > 1 else 0, 10 ** k)
                for k in (rng.randint(1, self.difficulty), rng.randint(1, nb)))
        if op == "-" and a < b:
            a, b = b, a
        value = a + b if op == "+" else a - b if op == "-" else a * b
        return Problem(self.name, f"What is {_digits(a)} {op} {_digits(b)}?", _digits(value),
                       {"a": a, "b": b, "op": op, "value": value})

    def reference_reasoning(self, problem: Problem, effort: str = "max") -> str:
        if check_effort(effort) == "low":
            return ""
        a, b, op = problem.meta["a"], problem.meta["b"], problem.meta["op"]
        if op == "*":
            partials = [a * int(y) * 10 ** i for i, y in enumerate(str(b)[::-1])]
            lines = [f"{_digits(a)} * {y}{' 0' * i} = {_digits(p)}" for i, (y, p) in
                     enumerate(zip(str(b)[::-1], partials))]
            if effort == "high":
                return "partials: " + " , ".join(_digits(p) for p in partials)
            return "\n".join(lines + ([f"sum = {_digits(sum(partials))}"] if len(partials) > 1 else []))
        cols = _columns(a, b, op)
        word = "carry" if op == "+" else "borrow"
        if effort == "high":
            return ("carries: " if op == "+" else "borrows: ") + spaced(c[4] for c in cols)
        return "\n".join(f"{x} {op} {y} {op} {c} = {d} {word} {out}" for x, y, c, d, out in cols)

    def check(self, problem: Problem, answer: str) -> bool:
        digits = "".join(answer.replace(",", " ").split())
        return digits == str(problem.meta["value"])
