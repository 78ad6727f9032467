"""Parity of labelled bits: "Parity: a 1 b 0 c 1 d 1" -> "odd" (is the number of 1s even or odd).

``difficulty`` d: 2..d bits (at most 26), labelled a, b, c, ... in order. The check compares the first word of the
answer (any case, a final "." ignored) with even / odd.

A task where reasoning pays: the answer is the XOR of every bit, which a model of decaying linear-attention and
softmax layers does not compute in one step for long inputs, while each step of a running parity is local.
Reasoning (every label and bit a separate token): at "max" the running parity after each bit, under its label
("a 1 b 1 c 0 d 1": each line's bit is the previous one XOR the label's bit, read from the prompt by its label,
which occurs once there); at "high" the running parity after every second bit and the last ("b 1 d 1"); at "low"
none.
"""

from __future__ import annotations

import random
import string
from dataclasses import dataclass

from .base import Problem, Task, check_difficulty, check_effort, first_word, spaced

LABELS = string.ascii_lowercase


def running(bits: list[int]) -> list[int]:
    """The parity of bits[0..i] for each i."""
    out, p = [], 0
    for b in bits:
        p ^= b
        out.append(p)
    return out


@dataclass(frozen=True)
class Parity(Task):
    difficulty: int = 12
    name = "parity"

    def __post_init__(self):
        check_difficulty(self.name, self.difficulty, 2, len(LABELS))

    def sample(self, rng: random.Random) -> Problem:
        bits = [rng.randint(0, 1) for _ in range(rng.randint(2, self.difficulty))]
        prompt = "Parity: " + spaced(f"{LABELS[i]} {b}" for i, b in enumerate(bits))
        return Problem(self.name, prompt, "odd" if sum(bits) % 2 else "even", {"bits": bits})

    def reference_reasoning(self, problem: Problem, effort: str = "max") -> str:
        if check_effort(effort) == "low":
            return ""
        bits = problem.meta["bits"]
        run = running(bits)
        steps = range(len(bits)) if effort == "max" else sorted({*range(1, len(bits), 2), len(bits) - 1})
        return spaced(f"{LABELS[i]} {run[i]}" for i in steps)

    def check(self, problem: Problem, answer: str) -> bool:
        return first_word(answer) == problem.answer
