"""Small Python functions: "Write the body of def f(xs): return the largest element of xs times 3." ->
"return max(xs) * 3", checked by running tests against it in the sandbox (sandbox.py: time and memory limits).

The answer is the function's body (indented under the given ``def`` line before it runs) or a whole ``def f``
(run as written); a code fence around it is removed (``final_answer``). It is right when every test case's
``assert f(input) == expected`` passes within ``timeout`` seconds and ``memory_mb`` of address space, and the
program then prints a fresh random token (so exiting early with status 0, ``sys.exit(0)`` in ``f``, is wrong too);
a syntax error, an exception, a crash or the timeout is wrong.

``difficulty`` 1: functions of a number; 2 (default): and of a list (sum, max, count, ...); 3: and list
transformations (filters, maps, sorted). Each problem is a template with its parameters; the expected outputs come
from the reference body on inputs seeded by the prompt. Reasoning at "max": a plan and two worked examples; at
"high" the plan; at "low" none.
"""

from __future__ import annotations

import random
import secrets
import textwrap
from dataclasses import dataclass

from .base import Problem, Task, check_difficulty, check_effort
from .sandbox import run_python

# (difficulty, argument, description with {a}/{b}, reference expression, plan)
TEMPLATES = (
    (1, "x", "return x times {a} plus {b}", "x * {a} + {b}", "multiply by {a}, add {b}"),
    (1, "x", "return x squared minus {a}", "x * x - {a}", "square, subtract {a}"),
    (1, "x", "return True when x is divisible by {a}", "x % {a} == 0", "remainder by {a} is zero"),
    (1, "x", "return the larger of x and {b}", "max(x, {b})", "compare with {b}"),
    (2, "xs", "return the sum of xs plus {b}", "sum(xs) + {b}", "add up, add {b}"),
    (2, "xs", "return the largest element of xs times {a}", "max(xs) * {a}", "maximum, multiply by {a}"),
    (2, "xs", "return the smallest element of xs minus {b}", "min(xs) - {b}", "minimum, subtract {b}"),
    (2, "xs", "return how many times {a} occurs in xs", "xs.count({a})", "count {a}"),
    (2, "xs", "return the length of xs times {a}", "len(xs) * {a}", "length, multiply by {a}"),
    (3, "xs", "return xs reversed, each element times {a}", "[v * {a} for v in xs[::-1]]",
     "reverse, multiply each by {a}"),
    (3, "xs", "return the elements of xs greater than {b}", "[v for v in xs if v > {b}]", "keep those above {b}"),
    (3, "xs", "return xs sorted, each element plus {b}", "[v + {b} for v in sorted(xs)]", "sort, add {b} to each"),
    (3, "xs", "return each element of xs modulo {a}", "[v % {a} for v in xs]", "remainder of each by {a}"),
)


def _inputs(arg: str, rng: random.Random, n: int) -> list:
    if arg == "x":
        return [rng.randint(-20, 40) for _ in range(n)]
    return [[rng.randint(0, 12) for _ in range(rng.randint(1, 6))] for _ in range(n)]


def program(signature: str, answer: str, cases: list, done: str) -> str:
    """The candidate as a function (its body under ``signature`` unless it is a whole ``def``), one assertion per
    case, then ``print(done)``."""
    code = answer if answer.lstrip().startswith("def ") else f"{signature}\n{textwrap.indent(answer, '    ')}"
    checks = "\n".join(f"assert f({x!r}) == {y!r}, {x!r}" for x, y in cases)
    return f"{code}\n\n{checks}\nprint({done!r})\n"


@dataclass(frozen=True)
class PythonFunctions(Task):
    difficulty: int = 2
    tests: int = 5  # assertions per problem
    timeout: float = 2.0  # seconds of wall clock per candidate
    memory_mb: int = 256
    name = "python"

    def __post_init__(self):
        check_difficulty(self.name, self.difficulty, 1, 3)
        if not isinstance(self.tests, int) or self.tests < 1:
            raise ValueError(f"python: tests must be an integer >= 1; got {self.tests!r}")

    def sample(self, rng: random.Random) -> Problem:
        pool = [t for t in TEMPLATES if t[0] <= self.difficulty]
        _, arg, desc, expr, plan = rng.choice(pool)
        a, b = rng.randint(2, 19), rng.randint(0, 60)
        desc, expr, plan = (s.format(a=a, b=b) for s in (desc, expr, plan))
        signature = f"def f({arg}):"
        prompt = f"Write the body of {signature} {desc}."
        body = f"return {expr}"
        ns: dict = {}
        exec(f"{signature}\n    {body}", ns)  # the reference (our own template) gives the expected outputs
        cases = [(x, ns["f"](x)) for x in _inputs(arg, random.Random(prompt), self.tests)]
        return Problem(self.name, prompt, body, {"signature": signature, "cases": cases, "plan": plan})

    def reference_reasoning(self, problem: Problem, effort: str = "max") -> str:
        if check_effort(effort) == "low":
            return ""
        plan = f"plan: {problem.meta['plan']}"
        if effort == "high":
            return plan
        return plan + "\n" + "\n".join(f"f({x!r}) = {y!r}" for x, y in problem.meta["cases"][:2])

    def check(self, problem: Problem, answer: str) -> bool:
        done = secrets.token_hex(16)
        source = program(problem.meta["signature"], answer, problem.meta["cases"], done)
        try:
            compile(source, "<candidate>", "exec")  # parsing runs nothing: a syntax error needs no subprocess
        except (SyntaxError, ValueError):
            return False
        result = run_python(source, self.timeout, self.memory_mb)
        return result.ok and result.stdout.rstrip().endswith(done)
