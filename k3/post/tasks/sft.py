"""Chat JSONL for the SFT cold start from the tasks' training split (the format ``k3.post.sft_data`` reads).

One line per problem:

    {"id": "arithmetic:0:17", "domain": "arithmetic", "effort": "max",
     "messages": [{"role": "user", "content": "What is 4 7 + 1 2?"},
                  {"role": "assistant", "content": "5 9", "reasoning_content": "7 + 2 + 0 = 9 carry 0\n..."}]}

``effort`` None: no effort tag, the "max" reasoning; "low" / "high" / "max": that tag and that effort's reasoning
(none at "low"). ``reasoning_content`` is left out when there is no reasoning (``with_reasoning=False`` or "low").
The file is written atomically (a temp file renamed over ``path``).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from ...atomic import atomic_path
from .base import Task, check_effort

__all__ = ["write_sft_jsonl"]


def write_sft_jsonl(path: str | Path, tasks: Sequence[str | Task], n_per_task: int, seed: int = 0,
                    effort: str | None = None, with_reasoning: bool = True) -> Path:
    """Write ``n_per_task`` distinct training problems of each task (a name or a Task) to ``path``; -> path."""
    from . import get_task

    if effort is not None:
        check_effort(effort)
    if isinstance(tasks, (str, Task)) or not tasks:
        raise ValueError(f"tasks must be a non-empty list of task names or Task objects; got {tasks!r}")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(path) as tmp, open(tmp, "w", encoding="utf-8") as f:
        for t in tasks:
            task = get_task(t) if isinstance(t, str) else t
            for i, p in enumerate(task.generate("train", n_per_task, seed)):
                reply = {"role": "assistant", "content": p.answer}
                reasoning = task.reference_reasoning(p, effort or "max") if with_reasoning else ""
                if reasoning:
                    reply["reasoning_content"] = reasoning
                f.write(json.dumps({"id": f"{task.name}:{seed}:{i}", "domain": task.name, "effort": effort,
                                    "messages": [{"role": "user", "content": p.prompt}, reply]},
                                   ensure_ascii=False) + "\n")
    return path
