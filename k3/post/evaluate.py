"""Held-out accuracy and reply length of a policy per (domain, effort) (SPEC §9's measurements).

    evaluate_policy(model, tokenizer, {"arithmetic": task}, ("low", "max"), n=64)
    -> {"arithmetic/low": {"accuracy": 0.41, "length": 12.3, "length_p90": 15, "length_max": 21}, ...}

Each test-split problem is asked once with the effort in the prompt; the reply is sampled by k3's engine
(``temperature`` 0 = greedy) and its answer (after the reasoning) checked by the task's verifier.
"""

from __future__ import annotations

from .format import ChatFormat
from .rollout import Rollout, Trajectory

__all__ = ["evaluate_policy", "ask"]


def ask(rollout: Rollout, fmt: ChatFormat, problems, effort: str | None, seed: int, group: int = 0
        ) -> list[Trajectory]:
    """One trajectory per problem, written to its end."""
    trajs = [Trajectory(group, fmt.prompt_ids([{"role": "user", "content": p.prompt}], effort), seed + i)
             for i, p in enumerate(problems)]
    rollout.round(trajs)
    return trajs


def evaluate_policy(model, tokenizer, tasks: dict, efforts, n: int, max_tokens: int = 256, temperature: float = 0.0,
                    seed: int = 0, dtype: str = "auto") -> dict[str, dict[str, float]]:
    fmt = ChatFormat(tokenizer)
    rollout = Rollout(model, tokenizer, fmt.stop, max_tokens, version=0, temperature=temperature, dtype=dtype)
    out = {}
    for name, task in tasks.items():
        problems = task.generate("test", n, seed)
        for effort in efforts:
            trajs = ask(rollout, fmt, problems, effort, seed)
            correct = [float(task.verify(p, fmt.parse(t.text, effort)[1])) for p, t in zip(problems, trajs)]
            lengths = sorted(len(t.tokens) for t in trajs)
            out[f"{name}/{effort}"] = {"accuracy": sum(correct) / len(correct), "length": sum(lengths) / len(lengths),
                                       "length_p90": lengths[int(0.9 * (len(lengths) - 1))],
                                       "length_max": lengths[-1]}
    return out
