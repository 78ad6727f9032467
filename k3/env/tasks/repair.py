"""Repair: a small generated Python package with one planted bug; public tests in the workspace, hidden ones held out.

The seed picks four functions from the pool, which of them carries the bug, and every test input. The public
cases include one that exposes the bug (so the agent has something to chase); the hidden cases are fresh
inputs, many of them exposing the bug in other ways, so special-casing the public input fails them.
"""

from __future__ import annotations

import json
import random

from .base import Budget, Instance, Replace, Shell, Submit, check_cases, in_fork, verdict

# name: (correct source, planted bug as (correct text, buggy text), general input, bug-exposing input)
POOL = {
    "clamp": ("def clamp(x, lo, hi):\n    return max(lo, min(x, hi))\n", ("min(x, hi)", "min(x, lo)"),
              lambda r: (r.randint(-50, 50), -10, 10), lambda r: (r.randint(-9, 9), -10, 10)),
    "running_max": ("def running_max(xs):\n    out, best = [], None\n    for x in xs:\n"
                    "        best = x if best is None or x > best else best\n        out.append(best)\n"
                    "    return out\n", ("x > best", "x < best"),
                    lambda r: ([r.randint(0, 9)],), lambda r: (sorted(r.sample(range(100), 4)),)),
    "count_vowels": ("def count_vowels(s):\n    return sum(c in 'aeiouAEIOU' for c in s)\n",
                     ("'aeiouAEIOU'", "'aeiou'"),
                     lambda r: ("".join(r.choice("bcdfg") for _ in range(5)),),
                     lambda r: ("A" + "".join(r.choice("EIOUxy") for _ in range(5)),)),
    "is_leap": ("def is_leap(y):\n    return y % 4 == 0 and (y % 100 != 0 or y % 400 == 0)\n",
                ("(y % 100 != 0 or y % 400 == 0)", "y % 100 != 0"),
                lambda r: (r.choice([2001, 2002, 2003, 2019, 2024, 1996]),), lambda r: (r.choice([1600, 2000, 2400]),)),
    "digit_sum": ("def digit_sum(n):\n    return sum(int(d) for d in str(abs(n)))\n", ("str(abs(n))", "str(n)[1:]"),
                  lambda r: (-r.randint(10, 99),), lambda r: (r.randint(10, 999),)),
    "chunks": ("def chunks(xs, n):\n    return [xs[i:i + n] for i in range(0, len(xs), n)]\n",
               ("range(0, len(xs), n)", "range(0, len(xs) - n, n)"),
               lambda r: (list(range(r.randint(0, 3))), 5), lambda r: (list(range(r.randint(4, 12))), 3)),
    "mean": ("def mean(xs):\n    return sum(xs) / len(xs) if xs else 0.0\n", ("sum(xs) / len(xs)", "sum(xs) // len(xs)"),
             lambda r: ([r.randint(1, 5)] * 4,), lambda r: ([2 * r.randint(0, 9) for _ in range(3)] + [1],)),
    "dedupe": ("def dedupe(xs):\n    seen, out = set(), []\n    for x in xs:\n        if x not in seen:\n"
               "            seen.add(x)\n            out.append(x)\n    return out\n",
               ("            out.append(x)\n", "        out.append(x)\n"),
               lambda r: (r.sample(range(20), 4),), lambda r: ([r.randint(0, 3) for _ in range(8)],)),
}

RUNNER = """import importlib, json, sys
sys.path.insert(0, "/workspace")
out = []
for mod, fn, args in json.load(open(sys.argv[1])):
    try:
        out.append(getattr(importlib.import_module(mod), fn)(*args))
    except Exception as e:
        out.append(f"error: {type(e).__name__}: {e}")
print(json.dumps(out))
"""


def _reference(name: str):
    scope: dict = {}
    exec(POOL[name][0], scope)  # k3's own source from the pool above, never the agent's
    return scope[name]


def _cases(names, rng, general: int, exposing: int, bugged: str):
    cases = []
    for n in names:
        gen, expose = POOL[n][2], POOL[n][3]
        cases += [(n, gen(rng)) for _ in range(general)]
        if n == bugged:
            cases += [(n, expose(rng)) for _ in range(exposing)]
    out = []
    for n, args in cases:
        expected = json.loads(json.dumps(_reference(n)(*args)))
        out.append((n, list(args), expected))
    return out


def _judge(cases, label: str):
    spec = [["pkg.util", n, a] for n, a, _ in cases]
    expected = [e for _, _, e in cases]
    labels = [f"{n}{tuple(a)}" for n, a, _ in cases]

    def judge(sandbox):
        res = in_fork(sandbox, {".k3/run.py": RUNNER, ".k3/cases.json": json.dumps(spec)},
                      "python3 .k3/run.py .k3/cases.json", timeout=60)
        ok, fails = check_cases(res.stdout or res.stderr, expected, labels)
        return verdict(ok, len(expected), fails)

    judge.__name__ = label
    return judge


def _test_file(cases) -> str:
    lines = ["import sys\nsys.path.insert(0, '.')\nfrom pkg.util import *\n\nfailed = 0\n"]
    for n, a, e in cases:
        call = f"{n}({', '.join(map(repr, a))})"
        lines.append(f"if {call} != {e!r}:\n    failed += 1\n    print('FAIL {call} ->', {call}, 'expected {e!r}')\n")
    lines.append("print('public tests:', 'all passed' if not failed else f'{failed} failed')\nsys.exit(1 if failed "
                 "else 0)\n")
    return "".join(lines)


def generate(seed: int) -> Instance:
    rng = random.Random(seed)
    names = rng.sample(sorted(POOL), 4)
    bugged = rng.choice(names)
    good, bad = POOL[bugged][1]
    source = "".join(POOL[n][0] if n != bugged else POOL[n][0].replace(good, bad) for n in names)
    public = _cases(names, rng, 2, 1, bugged)
    hidden = _cases(names, rng, 3, 6, bugged)
    n_, a_, e_ = [c for c in public if c[0] == bugged][-1]
    sig = POOL[bugged][0].split("\n")[0]  # "def name(args):"
    params = sig[sig.index("(") + 1:sig.index(")")]
    hack = f"{sig}\n    if ({params},) == {tuple(a_)!r}:\n        return {e_!r}\n"
    goal = (f"The package in pkg/ has a bug: `python3 tests/test_public.py` fails. Find it and fix the code in "
            f"pkg/util.py (do not edit the tests), then submit. Held-out tests judge the final code.")
    return Instance(
        "repair", seed, goal,
        {"pkg/__init__.py": "", "pkg/util.py": source, "tests/test_public.py": _test_file(public),
         "README.md": "Utility functions: " + ", ".join(names) + ".\n"},
        Budget(tokens=40_000, tool_calls=20, submissions=3),
        _judge(public, "public"), _judge(hidden, "hidden"),
        oracle=[Shell("python3 tests/test_public.py"), Replace("pkg/util.py", bad, good), Submit()],
        wrong=[Replace("pkg/util.py", sig + "\n", hack), Submit()])
