"""Small Python functions: "Write a Python function f(xs) that returns the largest element of xs." -> the code,
checked by running tests against it in a sandboxed subprocess (time and memory limits: sandbox.py).

Each problem is a template (what f computes) with its parameters; the reference answer is one line of code in
a ``def``. Reasoning: at max effort a plan and two worked examples, at high effort the plan, at low none.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from .base import Problem, Solution, check_effort
from .sandbox import run_python

# (argument, description with {a}/{b}, reference expression, plan)
TEMPLATES = (
    ("x", "returns x times {a} plus {b}", "x * {a} + {b}", "multiply by {a}, add {b}"),
    ("x", "returns x squared minus {a}", "x * x - {a}", "square, subtract {a}"),
    ("x", "returns True when x is divisible by {a}", "x % {a} == 0", "remainder by {a} is zero"),
    ("xs", "returns the sum of xs plus {a}", "sum(xs) + {a}", "add up, add {a}"),
    ("xs", "returns xs reversed, each element times {a}", "[v * {a} for v in xs[::-1]]",
     "reverse, multiply each by {a}"),
    ("xs", "returns the largest element of xs times {a}", "max(xs) * {a}", "maximum, multiply by {a}"),
    ("xs", "returns the smallest element of xs minus {a}", "min(xs) - {a}", "minimum, subtract {a}"),
    ("xs", "returns how many times {a} occurs in xs", "xs.count({a})", "count {a}"),
    ("xs", "returns the elements of xs greater than {a}", "[v for v in xs if v > {a}]", "keep those above {a}"),
    ("xs", "returns xs sorted, each element plus {a}", "[v + {a} for v in sorted(xs)]", "sort, add {a} to each"),
    ("xs", "returns the length of xs times {a}", "len(xs) * {a}", "length, multiply by {a}"),
    ("xs", "returns each element of xs modulo {a}", "[v % {a} for v in xs]", "remainder of each by {a}"),
)


def _inputs(arg: str, rng: random.Random, n: int) -> list:
    if arg == "x":
        return [rng.randint(-20, 40) for _ in range(n)]
    return [[rng.randint(-5, 12) for _ in range(rng.randint(1, 6))] for _ in range(n)]


def _code(arg: str, expr: str) -> str:
    return f"def f({arg}):\n    return {expr}"


@dataclass(frozen=True)
class PythonFunctions:
    tests: int = 5
    timeout: float = 2.0  # seconds of wall clock per candidate
    memory_mb: int = 256
    name: str = "python"

    def problem(self, rng: random.Random) -> Problem:
        t = rng.randrange(len(TEMPLATES))
        arg, desc, expr, plan = TEMPLATES[t]
        a, b = rng.randint(2, 19), rng.randint(0, 30)
        fill = lambda s: s.format(a=a, b=b)  # noqa: E731
        code = _code(arg, fill(expr))
        ns: dict = {}
        exec(code, ns)  # the reference (trusted: our own template) gives the expected outputs
        cases = [(x, ns["f"](x)) for x in _inputs(arg, random.Random(f"{t}:{a}:{b}"), self.tests)]
        return Problem(self.name, f"Write a Python function f({arg}) that {fill(desc)}.", code,
                       f"{t}:{fill(desc)}", {"cases": cases, "plan": fill(plan)})

    def solution(self, problem: Problem, effort: str) -> Solution:
        cases = problem.data["cases"][:2]
        examples = " ".join(f"f({x!r}) = {y!r}." for x, y in cases)
        reasoning = {"low": "", "high": f"plan: {problem.data['plan']}",
                     "max": f"plan: {problem.data['plan']}\n{examples}"}[check_effort(effort)]
        return Solution(reasoning, problem.answer)

    def verify(self, problem: Problem, answer: str) -> bool:
        try:
            compile(answer, "<candidate>", "exec")  # parsing runs nothing: a syntax error needs no subprocess
        except (SyntaxError, ValueError):
            return False
        return run_python(test_program(answer, problem.data["cases"]), self.timeout, self.memory_mb).ok


def test_program(code: str, cases: list) -> str:
    """The candidate's code followed by one assertion per case (run in the sandbox)."""
    checks = "\n".join(f"assert f({x!r}) == {y!r}" for x, y in cases)
    return f"{code}\n\n{checks}\n"
