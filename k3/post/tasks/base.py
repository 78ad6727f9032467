"""What a verifiable task is (SPEC §9): seeded problems, a held-out split, a reference answer with worked
reasoning at three efforts, and a verifier that is a plain Python function.

A ``Problem`` is plain data (``domain``, ``prompt``: the user's message, ``answer``: the reference final answer,
``meta``: what the verifier needs). A ``Task`` draws problems (``sample(rng)``); the split of a problem is a
stable hash of its domain and prompt (``split_of``): TEST_FRACTION of all prompts are held out, whatever the seed,
the difficulty or the order of generation, so a test prompt is never a training prompt.

Answer parsing (``final_answer``), the same for every task: the text after the last ``</think>`` if there is one,
then the text after the last ``Answer:`` (any case) if there is one, else the whole text; surrounding whitespace
and a Markdown code fence around the whole of it are removed. Each task then compares that final answer leniently
in its own way (documented in its module): spacing between tokens never matters.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Iterator
from dataclasses import dataclass, field

__all__ = ["EFFORTS", "SPLITS", "TEST_FRACTION", "Problem", "Task", "split_of", "stream", "final_answer"]

EFFORTS = ("low", "high", "max")
SPLITS = ("train", "test")
TEST_FRACTION = 0.1  # of all prompts (by their hash): the held-out split


@dataclass(frozen=True)
class Problem:
    domain: str  # the task's name
    prompt: str  # the user's message; equal prompts are the same problem
    answer: str  # the reference final answer (the SFT target)
    meta: dict = field(default_factory=dict, compare=False)  # what the verifier and the reasoning need

    @property
    def split(self) -> str:
        return split_of(self.domain, self.prompt)


def split_of(domain: str, prompt: str) -> str:
    """"test" for TEST_FRACTION of all prompts (a stable hash of domain and prompt), else "train"."""
    h = int.from_bytes(hashlib.blake2b(f"{domain}\x00{prompt}".encode(), digest_size=8).digest(), "big")
    return "test" if h < TEST_FRACTION * 2**64 else "train"


def final_answer(text: str) -> str:
    """The final answer of a reply (the rule in the module docstring)."""
    if "</think>" in text:
        text = text.rpartition("</think>")[2]
    at = text.lower().rfind("answer:")
    if at >= 0:
        text = text[at + len("answer:"):]
    text = text.strip()
    if text.startswith("```") and text.endswith("```") and len(text) >= 6:
        text = text[3:-3]
        first, nl, rest = text.partition("\n")
        text = rest if nl and first.strip().isidentifier() else text  # drop a language tag ("python")
        text = text.strip()
    return text


class Task:
    """A domain of verifiable problems. Subclasses are frozen dataclasses with a ``difficulty`` field and define
    ``name``, ``sample``, ``reference_reasoning`` and ``check``."""

    name: str
    difficulty: int

    def sample(self, rng: random.Random) -> Problem:
        """One problem of either split."""
        raise NotImplementedError

    def reference_reasoning(self, problem: Problem, effort: str = "max") -> str:
        """A worked solution: every step at "max" (its length grows with the difficulty), a sketch at "high",
        nothing at "low"."""
        raise NotImplementedError

    def check(self, problem: Problem, answer: str) -> bool:
        """Whether ``answer`` (already through ``final_answer``) is correct."""
        raise NotImplementedError

    def verify(self, problem: Problem, answer_text: str) -> float:
        """1.0 when the final answer of ``answer_text`` (``final_answer``) is correct, else 0.0."""
        if problem.domain != self.name:
            raise ValueError(f"the problem is of task {problem.domain!r}; verify it with get_task({problem.domain!r})")
        return 1.0 if self.check(problem, final_answer(answer_text)) else 0.0

    def generate(self, split: str, n: int, seed: int = 0) -> list[Problem]:
        """The first ``n`` distinct problems of ``split`` drawn by a generator seeded with ``seed``."""
        if n < 0:
            raise ValueError(f"n must be >= 0; got {n}")
        out, seen = [], set()
        for i, p in enumerate(stream(self, split, seed)):
            if len(out) == n:
                break
            if i > 200 * n + 1000:
                raise ValueError(f"the task {self.name!r} at difficulty {self.difficulty} has fewer than {n} distinct "
                                 f"{split} problems (found {len(out)}); ask for fewer or raise the difficulty")
            if p.prompt not in seen:
                seen.add(p.prompt)
                out.append(p)
        return out


def stream(task: Task, split: str, seed: int = 0, start: int = 0) -> Iterator[Problem]:
    """Endless problems of ``split`` (with repeats), from a generator seeded with ``seed``; ``start`` skips that many
    first (a resumed run's cursor)."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}; got {split!r}")
    rng = random.Random(f"{task.name}:{task.difficulty}:{seed}")
    emitted = 0
    while True:
        p = task.sample(rng)
        if p.split != split:
            continue
        if emitted >= start:
            yield p
        emitted += 1


def check_effort(effort: str) -> str:
    if effort not in EFFORTS:
        raise ValueError(f"effort must be one of {EFFORTS}; got {effort!r}")
    return effort


def check_difficulty(task: str, difficulty, lo: int, hi: int) -> None:
    if not isinstance(difficulty, int) or not lo <= difficulty <= hi:
        raise ValueError(f"{task}: difficulty must be an integer in [{lo}, {hi}]; got {difficulty!r}")


def spaced(items) -> str:
    """Items written apart ("4 0 7"): every digit is one token under any byte-level BPE."""
    return " ".join(str(x) for x in items)


def unspace(text: str) -> str:
    return "".join(text.split())


def first_word(text: str) -> str:
    """The answer's first word in lower case, a final "." dropped ("Yes." -> "yes"; "" when there is none): how
    one-word answers (yes / no, even / odd) are compared."""
    words = text.split()
    return words[0].lower().rstrip(".") if words else ""
