"""Verifiable tasks generated in-process (no download), each with a held-out split (SPEC §9).

    from k3.post.tasks import TASKS, problems
    task = TASKS["arithmetic"]
    p = problems(task, "test", 1)[0]          # Problem(prompt="What is 4 7 + 1 2 5?", answer="1 7 2", ...)
    task.solution(p, "max").reasoning          # the worked steps; "high": a sketch; "low": ""
    task.verify(p, "1 7 2")                    # True

``arithmetic`` (multi-digit addition), ``sorting`` (digits), ``brackets`` (close the open brackets), ``python``
(small functions run against tests in a sandboxed subprocess with time and memory limits).
"""

from .arithmetic import Arithmetic
from .base import EFFORTS, SPLITS, Problem, Solution, Task, problems, split_of, stream
from .brackets import Brackets
from .python_fn import PythonFunctions
from .sandbox import SandboxResult, run_python
from .sorting import Sorting

TASKS: dict[str, Task] = {t.name: t for t in (Arithmetic(), Sorting(), Brackets(), PythonFunctions())}

__all__ = ["TASKS", "EFFORTS", "SPLITS", "Problem", "Solution", "Task", "problems", "split_of", "stream", "Arithmetic",
           "Sorting", "Brackets", "PythonFunctions", "run_python", "SandboxResult", "get_task"]


def get_task(name: str) -> Task:
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; choose from {sorted(TASKS)}")
    return TASKS[name]
