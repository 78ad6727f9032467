"""Verifiable tasks generated in-process, no download, each with a held-out split (SPEC §9).

    from k3.post.tasks import get_task
    task = get_task("arithmetic")                 # or Arithmetic(difficulty=4, ops=("+",))
    p = task.generate("test", 1, seed=0)[0]       # Problem(domain="arithmetic", prompt="What is 4 7 + 1 2?",
                                                  #         answer="5 9", meta={...})
    task.reference_reasoning(p)                   # the worked steps ("high": a sketch, "low": "")
    task.verify(p, "... Answer: 5 9")             # 1.0

``arithmetic`` (+, -, * of multi-digit numbers), ``sorting`` (a list of integers), ``brackets`` (close the open
brackets / is it balanced), ``parity`` (of labelled bits), ``python`` (a function body run against tests in a
sandboxed subprocess).
``write_sft_jsonl`` writes their training split as chat JSONL for ``k3 sft``.
"""

from __future__ import annotations

from .arithmetic import Arithmetic
from .base import EFFORTS, SPLITS, TEST_FRACTION, Problem, Task, final_answer, split_of, stream
from .brackets import Brackets
from .parity import Parity
from .python_fn import PythonFunctions
from .sandbox import SandboxResult, run_python
from .sft import write_sft_jsonl
from .sorting import Sorting

TASKS: dict[str, Task] = {t.name: t for t in (Arithmetic(), Sorting(), Brackets(), Parity(),
                                              PythonFunctions())}

__all__ = ["TASKS", "EFFORTS", "SPLITS", "TEST_FRACTION", "Problem", "Task", "get_task", "split_of", "stream",
           "final_answer", "Arithmetic", "Sorting", "Brackets", "Parity", "PythonFunctions", "run_python",
           "SandboxResult", "write_sft_jsonl"]


def get_task(name: str) -> Task:
    """The registered task ``name`` at its default difficulty."""
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; the known tasks are {sorted(TASKS)}")
    return TASKS[name]
