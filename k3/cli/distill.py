"""k3 distill: multi-teacher on-policy distillation (MOPD, SPEC §9; k3.post.rl with teachers).

The student samples; the teacher of each prompt's (task, effort) scores every token; the per-token reward
clip(log pi_T(y_t) - log pi_S(y_t), -R_max, R_max) goes through the RL loop of ``k3 rl`` (partial rollout too).
"""

from __future__ import annotations

from . import rl

HELP = "multi-teacher on-policy distillation: one student from a teacher per (task, effort)"


def add_arguments(p) -> None:
    rl.add_rl_arguments(p, distill=True)


def run(args) -> int:
    return rl.run(args, distill=True)
