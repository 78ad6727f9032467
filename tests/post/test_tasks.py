"""The embedded verifiable tasks (k3.post.tasks): deterministic generators, disjoint held-out splits, verifiers
that accept the reference and reject wrong answers, the answer-parsing rule, the Python sandbox's limits, and the
SFT JSONL that k3.post.sft_data reads."""

from __future__ import annotations

import json
import random
import os
import socket
import time
from statistics import mean

import pytest

from k3.post.sft_data import load_conversations
from k3.post.tasks import (TASKS, Arithmetic, Brackets, Problem, PythonFunctions, Sorting, final_answer, get_task,
                           run_python, split_of, write_sft_jsonl)

NAMES = ["arithmetic", "sorting", "brackets", "parity", "python"]


def wrong(p: Problem) -> list[str]:
    """Answers that must be rejected."""
    if p.domain == "arithmetic":
        v = p.meta["value"]
        return [" ".join(str(v + 1)), " ".join(str(v) + "1"), "", "five"]
    if p.domain == "sorting":
        xs = p.meta["xs"]
        out = [" ".join(map(str, sorted(xs)[:-1])), " ".join(map(str, sorted(xs) + [0]))]
        if len(set(xs)) > 1:
            out.append(" ".join(map(str, sorted(xs, reverse=True))))
        return out
    if p.domain == "parity":
        return ["even" if p.answer == "odd" else "odd", "", "1"]
    if p.domain == "brackets":
        if p.meta["kind"] == "balanced":
            return ["no" if p.answer == "yes" else "yes", ""]
        return [p.answer + " )", p.answer.split(" ", 1)[1] if " " in p.answer else "", "yes"]
    return ["return None", "return f(", "pass", "raise ValueError('no')"]


def test_registry():
    assert sorted(TASKS) == sorted(NAMES)
    assert all(get_task(n).name == n for n in NAMES)
    with pytest.raises(ValueError, match=r"unknown task 'chess'.*'arithmetic'.*'sorting'"):
        get_task("chess")


@pytest.mark.parametrize("name", NAMES)
def test_generate_is_deterministic_distinct_and_of_its_split(name):
    task = get_task(name)
    a, b = task.generate("train", 50, seed=3), task.generate("train", 50, seed=3)
    assert a == b and [p.meta for p in a] == [p.meta for p in b]
    assert task.generate("train", 50, seed=4) != a
    assert len({p.prompt for p in a}) == 50
    test = task.generate("test", 20, seed=3)
    assert all(p.split == "train" for p in a) and all(p.split == "test" for p in test)
    assert all(p.domain == name and len(p.prompt) < 100 for p in a + test)  # tens of tokens


@pytest.mark.parametrize("name,n_train,n_test", [("arithmetic", 3000, 300), ("sorting", 3000, 300),
                                                 ("brackets", 3000, 300), ("parity", 3000, 300),
                                                 ("python", 600, 60)])
def test_splits_never_share_a_problem(name, n_train, n_test):
    task = get_task(name)
    train = {p.prompt for s in (0, 1) for p in task.generate("train", n_train, seed=s)}
    test = {p.prompt for s in (0, 1) for p in task.generate("test", n_test, seed=s)}
    assert len(train) >= n_train and len(test) >= n_test and not train & test
    # membership is the hash of the prompt, whatever the difficulty that drew it
    other = type(task)(difficulty=task.difficulty + 1).generate("train", n_train, seed=0)
    assert not {p.prompt for p in other} & test
    assert all(split_of(name, t) == "test" for t in test)


@pytest.mark.parametrize("name", NAMES)
def test_verify_accepts_the_reference_and_rejects_wrong_answers(name):
    task = get_task(name)
    problems = task.generate("test", 40 if name != "python" else 8, seed=0)
    for p in problems:
        assert task.verify(p, p.answer) == 1.0, p
        reply = f"<think>\n{task.reference_reasoning(p)}\n</think>\nAnswer: {p.answer}\n"
        assert task.verify(p, reply) == 1.0, p
        for w in wrong(p):
            assert task.verify(p, w) == 0.0, (p, w)
            assert task.verify(p, f"Answer: {p.answer}\nAnswer: {w}") == 0.0, (p, w)  # the last one counts


def test_verify_refuses_another_tasks_problem():
    p = get_task("sorting").generate("train", 1)[0]
    with pytest.raises(ValueError, match="get_task\\('sorting'\\)"):
        get_task("arithmetic").verify(p, p.answer)


def test_final_answer_rule():
    assert final_answer("  5 9 \n") == "5 9"
    assert final_answer("the sum is\nAnswer: 5 9") == "5 9"
    assert final_answer("answer: 1\nso ANSWER:  2 ") == "2"
    assert final_answer("<think>Answer: 3</think>\n4") == "4"
    assert final_answer("```python\nreturn x\n```") == "return x"
    assert final_answer("```\nreturn x\n```") == "return x"


def test_lenient_forms():
    ar = Arithmetic(ops=("+",))
    p = Problem("arithmetic", "What is 4 7 + 5?", "5 2", {"a": 47, "b": 5, "op": "+", "value": 52})
    assert ar.verify(p, "52") == ar.verify(p, "5 2") == ar.verify(p, "Answer: 5,2") == 1.0
    assert ar.verify(p, "Answer: 5 2 0") == 0.0
    br = Brackets()
    q = br.generate("train", 200)
    yes = next(p for p in q if p.meta["kind"] == "balanced" and p.answer == "yes")
    assert br.verify(yes, "Yes.") == 1.0 and br.verify(yes, "YES it is") == 1.0 and br.verify(yes, "no") == 0.0
    close = next(p for p in q if p.meta["kind"] == "close" and " " in p.answer)
    assert br.verify(close, close.answer.replace(" ", "")) == 1.0


def test_python_answers_body_def_or_fenced():
    task = PythonFunctions()
    p = Problem("python", "Write the body of def f(xs): return the sum of xs plus 3.", "return sum(xs) + 3",
                {"signature": "def f(xs):", "cases": [([1, 2], 6), ([0], 3), ([5, 5, 5], 18)], "plan": ""})
    assert task.verify(p, "total = 3\nfor v in xs:\n    total += v\nreturn total") == 1.0
    assert task.verify(p, "def f(xs):\n    return 3 + sum(xs)") == 1.0
    assert task.verify(p, "Answer:\n```python\nreturn sum(xs) + 3\n```") == 1.0
    assert task.verify(p, "return sum(xs) + 2") == 0.0
    assert task.verify(p, "import sys\nsys.exit(0)") == 0.0  # exiting 0 before the tests ran is still not passing
    assert task.verify(p, "import os\nos._exit(0)") == 0.0
    assert task.verify(p, "print('noise')\nreturn sum(xs) + 3") == 1.0  # printing is allowed


@pytest.mark.parametrize("name", NAMES)
def test_reference_reasoning_by_effort_and_difficulty(name):
    task = get_task(name)
    ps = task.generate("train", 100, seed=1)
    lengths = {e: mean(len(task.reference_reasoning(p, e)) for p in ps) for e in ("low", "high", "max")}
    assert lengths["low"] == 0 < lengths["high"] < lengths["max"]
    with pytest.raises(ValueError, match="effort must be one of"):
        task.reference_reasoning(ps[0], "medium")
    harder = type(task)(difficulty=task.difficulty + 1)
    longer = mean(len(harder.reference_reasoning(p)) for p in harder.generate("train", 100, seed=1))
    assert longer > lengths["max"]


def test_difficulty_sets_the_size():
    assert max(len(str(p.meta["a"])) for p in Arithmetic(difficulty=4).generate("train", 300)) == 4
    assert max(len(str(p.meta["a"])) for p in Arithmetic(difficulty=1).generate("train", 50)) == 1
    assert max(len(p.meta["xs"]) for p in Sorting(difficulty=9).generate("train", 300)) == 9
    assert max(len(p.meta["symbols"]) for p in Brackets(difficulty=12).generate("train", 300)) <= 12
    assert {p.meta["op"] for p in Arithmetic(ops=("*",)).generate("train", 30)} == {"*"}
    for bad in (lambda: Arithmetic(difficulty=0), lambda: Sorting(difficulty=1), lambda: PythonFunctions(difficulty=4)):
        with pytest.raises(ValueError, match="difficulty must be an integer in"):
            bad()
    with pytest.raises(ValueError, match="ops must be a non-empty subset"):
        Arithmetic(ops=("/",))
    with pytest.raises(ValueError, match="split must be one of"):
        Sorting().generate("valid", 3)
    with pytest.raises(ValueError, match="fewer than 50 distinct"):
        Arithmetic(difficulty=1, ops=("+",)).generate("test", 50)


def test_parity_problem_and_traces():
    """The running parity under each label at max, every second one and the last at high; the answer the XOR."""
    from k3.post.tasks import Parity

    task = Parity(difficulty=6)
    p = Problem("parity", "Parity: a 1 b 0 c 1 d 1 e 0", "odd", {"bits": [1, 0, 1, 1, 0]})
    assert task.reference_reasoning(p, "max") == "a 1 b 1 c 0 d 1 e 1"
    assert task.reference_reasoning(p, "high") == "b 1 d 1 e 1"
    assert task.reference_reasoning(p, "low") == ""
    assert task.verify(p, "<think>\na 1 b 1 c 0 d 1 e 1\n</think>\nAnswer: Odd.") == 1.0
    for q in task.generate("train", 80, seed=0):
        bits = q.meta["bits"]
        assert 2 <= len(bits) <= 6 and q.answer == ("odd" if sum(bits) % 2 else "even")
        assert q.prompt == "Parity: " + " ".join(f"{chr(97 + i)} {b}" for i, b in enumerate(bits))
        assert task.reference_reasoning(q, "max").split()[-1] == str(sum(bits) % 2)
    with pytest.raises(ValueError, match="difficulty must be an integer in"):
        Parity(difficulty=27)


def test_sorting_long_tail_lengths():
    """lengths="long-tail": P(n) = (1/n) / sum_k 1/k over 2..d; most lists short, the longest still drawn."""
    from collections import Counter

    d, draws = 16, 4000
    rng = random.Random(0)
    task = Sorting(difficulty=d, lengths="long-tail")
    counts = Counter(len(task.sample(rng).meta["xs"]) for _ in range(draws))
    z = sum(1 / k for k in range(2, d + 1))
    for n in range(2, d + 1):  # within 4 binomial standard errors of the stated law
        p = 1 / n / z
        assert abs(counts[n] / draws - p) < 4 * (p * (1 - p) / draws) ** 0.5, n
    uniform = Counter(len(Sorting(difficulty=d).sample(rng).meta["xs"]) for _ in range(draws))
    assert uniform[2] < counts[2] / 2 and uniform[d] > 2 * counts[d]
    with pytest.raises(ValueError, match="lengths must be one of"):
        Sorting(lengths="zipf")


def test_sorting_counting_trace_lists_each_value_and_its_occurrences():
    """trace="counting": every value 0..max_value in order, each followed by its occurrences or "-"; the
    occurrences in order are the answer, and the trace's length does not grow with the square of the list's."""
    task = Sorting(difficulty=6, trace="counting")
    rng = random.Random(3)
    for _ in range(50):
        p = task.sample(rng)
        words = task.reference_reasoning(p, "max").split()
        assert words.count(":") == task.max_value + 1
        occ = [int(w) for w, nxt in zip(words, words[1:] + [""]) if w not in (":", "-") and nxt != ":"]
        assert occ == sorted(p.meta["xs"]) and " ".join(map(str, occ)) == p.answer
        assert task.reference_reasoning(p, "low") == "" and task.reference_reasoning(p, "high").startswith("n = ")
    p = Problem("sorting", "Sort: 3 0 3", "0 3 3", {"xs": [3, 0, 3]})
    assert Sorting(max_value=3, trace="counting").reference_reasoning(p, "max") == "0 : 0 1 : - 2 : - 3 : 3 3"
    with pytest.raises(ValueError, match="trace must be one of"):
        Sorting(trace="bubble")


@pytest.mark.parametrize("xs,values", [
    ([7], "7"), ([4, 4], "4"), ([9, 0], "0 9"), ([5, 3, 9, 1, 3], "1 3 5 9"), ([2, 2, 2, 0, 2], "0 2"),
    ([3, 2, 1, 0], "0 1 2 3"),
])
def test_sorting_distinct_trace_sketch_then_the_values_in_order(xs, values):
    """trace="distinct": high's sketch (length and extremes), then the distinct values in ascending order; the final
    answer writes each as often as the prompt has it, and checks as correct."""
    p = Problem("sorting", f"Sort: {' '.join(map(str, xs))}", " ".join(map(str, sorted(xs))), {"xs": xs})
    task = Sorting(trace="distinct")
    reasoning = task.reference_reasoning(p, "max")
    sketch = task.reference_reasoning(p, "high")
    assert reasoning == f"n = {len(xs)} , min = {min(xs)} , max = {max(xs)}\n{values}" and reasoning.startswith(sketch)
    assert sorted(set(p.answer.split()), key=int) == values.split() and task.check(p, p.answer)
    assert task.verify(p, f"<think>\n{reasoning}\n</think>\n{p.answer}") == 1.0
    assert task.reference_reasoning(p, "low") == ""
    with pytest.raises(ValueError, match=r"sorting: trace must be one of .*'counting', 'distinct'.*got 'Distinct'"):
        Sorting(trace="Distinct")


# ------------------------------------------------------------------------------------------------- the sandbox

def test_sandbox_runs_correct_code():
    r = run_python("import math\nassert math.factorial(5) == 120\nprint('done')\n")
    assert r.ok and r.returncode == 0 and not r.timed_out and r.stdout == "done\n"
    r = run_python("assert 1 == 2, 'boom'")
    assert not r.ok and r.returncode == 1 and "AssertionError: boom" in r.stderr


def test_sandbox_kills_an_infinite_loop_in_time():
    t = time.monotonic()
    r = run_python("while True:\n    pass\n", timeout=1.0)
    assert r.timed_out and not r.ok and r.returncode is None
    assert time.monotonic() - t < 4.0


def test_sandbox_cannot_hang_the_parent():
    # a child that ignores SIGTERM and leaves a sleeping grandchild holding its stdout and stderr
    src = ("import os, signal, sys, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
           "pid = os.fork()\nif pid == 0:\n    time.sleep(60)\nelse:\n    sys.stderr.write(f'grandchild {pid}\\n')\n"
           "    sys.stderr.flush()\n    time.sleep(60)\n")
    t = time.monotonic()
    r = run_python(src, timeout=1.0)
    assert r.timed_out and time.monotonic() - t < 4.0
    pid = int(r.stderr.split()[-1])
    for _ in range(50):  # killed with its group (it may linger a moment as a zombie of init)
        try:
            with open(f"/proc/{pid}/status") as f:
                if "State:\tZ" in f.read():
                    break
        except FileNotFoundError:
            break
        time.sleep(0.05)
    else:
        pytest.fail(f"the grandchild {pid} is still running")


def test_sandbox_refuses_a_memory_bomb():
    for bomb in ("x = bytearray(8 * 1024**3)", "xs = []\nwhile True:\n    xs.append(bytearray(10**7))"):
        t = time.monotonic()
        r = run_python(bomb, timeout=5.0, memory_mb=128)
        assert not r.ok and not r.timed_out and "MemoryError" in r.stderr, r
        assert time.monotonic() - t < 4.0


def test_sandbox_has_no_network():
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        src = f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=1).close()\n"
        probe = run_python(src, timeout=3.0)
        assert not probe.ok and ("Errno" in probe.stderr or "disabled" in probe.stderr), probe
        with socket.create_connection(("127.0.0.1", port), timeout=1):  # the same code works outside
            pass


def test_sandbox_runs_in_an_empty_temp_dir_without_the_environment():
    r = run_python("import os\nassert sorted(os.listdir('.')) == ['.stderr', '.stdout', 'candidate.py'], "
                   "os.listdir('.')\nassert 'HOME' not in os.environ\n")
    assert r.ok, r.stderr
    with pytest.raises(ValueError, match="timeout must be > 0"):
        run_python("pass", timeout=0)
    with pytest.raises(ValueError, match="memory_mb must be an integer >= 32"):
        run_python("pass", memory_mb=8)


# --------------------------------------------------------------------------------------------------- SFT data

@pytest.mark.parametrize("effort,with_reasoning", [(None, True), ("high", True), ("max", False), ("low", True)])
def test_write_sft_jsonl_is_what_sft_reads(tmp_path, effort, with_reasoning):
    path = write_sft_jsonl(tmp_path / "d" / "sft.jsonl", ["arithmetic", Sorting(difficulty=4)], 5, seed=2,
                           effort=effort, with_reasoning=with_reasoning)
    assert os.listdir(path.parent) == ["sft.jsonl"]  # no temp file left
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    convs = load_conversations(path)
    assert len(lines) == len(convs) == 10
    assert [r["domain"] for r in lines] == ["arithmetic"] * 5 + ["sorting"] * 5
    tasks = {"arithmetic": get_task("arithmetic"), "sorting": Sorting(difficulty=4)}
    expected = tasks["arithmetic"].generate("train", 5, seed=2) + tasks["sorting"].generate("train", 5, seed=2)
    for r, c, p in zip(lines, convs, expected):
        user, reply = r["messages"]
        assert r["effort"] == c.effort == effort and c.messages == r["messages"]
        assert user == {"role": "user", "content": p.prompt} and reply["content"] == p.answer
        reasoning = tasks[p.domain].reference_reasoning(p, effort or "max") if with_reasoning else ""
        assert reply.get("reasoning_content", "") == reasoning and ("reasoning_content" in reply) == bool(reasoning)
        assert tasks[p.domain].verify(p, reply["content"]) == 1.0


def test_write_sft_jsonl_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="effort must be one of"):
        write_sft_jsonl(tmp_path / "x.jsonl", ["sorting"], 2, effort="medium")
    with pytest.raises(ValueError, match="non-empty list of task names"):
        write_sft_jsonl(tmp_path / "x.jsonl", "sorting", 2)
    with pytest.raises(ValueError, match="unknown task"):
        write_sft_jsonl(tmp_path / "x.jsonl", ["sorting", "chess"], 2)
    assert not (tmp_path / "x.jsonl").exists() and os.listdir(tmp_path) == []
