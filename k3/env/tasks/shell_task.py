"""A multi-step shell task: find the log files, pick out the ERROR lines, count them per service, report.

The workspace holds a tree of logs with decoys: .txt files that must be ignored, and INFO lines whose message
mentions ERROR. The agent writes report.sh (the report for any log tree given as $1) and report.txt (its
output for logs/). The public verifier checks report.txt; the hidden one runs report.sh on a held-out log tree
generated from another seed, so a report.txt typed in by hand, or a script that echoes it, fails.
"""

from __future__ import annotations

import collections
import random

from .base import Budget, Instance, Shell, Submit, Write, in_fork, verdict

SERVICES = ("auth", "billing", "cache", "db", "gateway", "mailer", "search", "worker")
ORACLE = """#!/bin/sh
# every *.log under $1; the level is the second field; count the third (the service) per ERROR line
find "$1" -type f -name '*.log' -exec cat {} + | awk '$2 == "ERROR" {print $3}' | sort | uniq -c \\
  | sort -k1,1nr -k2,2 | awk '{print $2, $1}'
"""


def logs(rng: random.Random, root: str) -> tuple[dict[str, str], str]:
    """A log tree under ``root`` and its report (``service count`` lines, most errors first, then by name)."""
    files, counts = {}, collections.Counter()
    services = rng.sample(SERVICES, 5)
    for day in range(rng.randint(2, 4)):
        for svc in rng.sample(services, 3):
            lines = []
            for i in range(rng.randint(5, 30)):
                level = rng.choice(["INFO", "INFO", "WARN", "ERROR"])
                msg = rng.choice(["request done", "retrying after ERROR 503", "cache miss", "timeout"])
                if level == "ERROR":
                    counts[svc] += 1
                lines.append(f"2026-01-{day + 1:02d}T10:{i:02d}:00 {level} {svc} {msg}")
            files[f"{root}/2026-01-{day + 1:02d}/{svc}.log"] = "\n".join(lines) + "\n"
        decoy = rng.choice(services)
        files[f"{root}/2026-01-{day + 1:02d}/{decoy}.txt"] = f"2026-01-01T00:00:00 ERROR {decoy} not a log\n" * 3
    report = "".join(f"{s} {n}\n" for s, n in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))
    return files, report


def generate(seed: int) -> Instance:
    rng = random.Random(seed)
    files, report = logs(rng, "logs")
    held_out, held_report = logs(random.Random(seed + 1_000_003), ".k3/heldout")

    def public(sandbox):
        try:
            got = sandbox.read("report.txt").decode(errors="replace")
        except (OSError, ValueError):
            return verdict(0, 1, ["no report.txt in the workspace"])
        want = report.splitlines()
        fails = [f"line {i + 1}: got {g!r}, expected a different line" for i, (g, w)
                 in enumerate(zip(got.splitlines(), want)) if g != w]
        if len(got.splitlines()) != len(want):
            fails.append(f"{len(got.splitlines())} lines; the logs have {len(want)} services with errors")
        return verdict(len(want) + 1 - len(fails), len(want) + 1, fails)

    def hidden(sandbox):
        r = in_fork(sandbox, held_out, "test -f report.sh || { echo no report.sh; exit 1; }; sh report.sh "
                    ".k3/heldout", timeout=60)
        fails = [] if r.stdout == held_report else [f"report.sh on other logs printed {r.stdout[:120]!r}"]
        pub = public(sandbox)
        return verdict(2 - len(fails) - (not pub.passed), 2, fails + ([] if pub.passed else [pub.feedback]))

    goal = ("logs/ holds application logs (one line: timestamp LEVEL service message). Write report.sh, a POSIX "
            "shell script that, given a directory as $1, prints one line 'service count' for every service with "
            "at least one ERROR-level line in the *.log files anywhere under it (other files do not count), "
            "sorted by count (most first) then by service name. Run it on logs/ and save its output as "
            "report.txt. Submit when done.")
    hack = f"#!/bin/sh\ncat <<'EOF'\n{report}EOF\n"
    return Instance(
        "shell", seed, goal, files, Budget(tokens=40_000, tool_calls=25, submissions=3), public, hidden,
        oracle=[Shell("find logs -type f | head; head -3 $(find logs -name '*.log' | head -1)"),
                Write("report.sh", ORACLE), Shell("sh report.sh logs > report.txt && cat report.txt"), Submit()],
        wrong=[Write("report.txt", report), Write("report.sh", hack), Submit()])
