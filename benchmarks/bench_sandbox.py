"""k3.env.Sandbox latencies (issue 45) against AgentENV's published figures (seed 000 §8.4).

    python benchmarks/bench_sandbox.py [--mb 100] [--repeat 10] [--json out.json]

Rows (median and 90th percentile over --repeat runs, milliseconds):
- create: an empty sandbox; and one whose base holds the 100 MB workspace (the bytes are written once);
- exec round trip: ``true`` as a fresh process tree (bwrap per call), and in the persistent shell;
- pause / resume: the freezer cgroup, with the shell and a busy background loop inside;
- fork and snapshot of a 100 MB workspace: with the 100 MB in the shared base plus 1 MB changed since (what an
  episode looks like: the task's files are the base), and with the 100 MB written by the sandbox itself (all of
  it in the private layer: a byte copy, as there is no reflink here); snapshot again after 1 MB more changed
  (incremental: unchanged files are hard links into the previous snapshot); restore of the 100 MB snapshot
  (its layers mounted under an empty upper: no bytes copied).
AgentENV (Firecracker microVMs): pause < 100 ms, resume < 50 ms, checkpoint / resume 133 / 49 ms. The issue's
targets: pause and resume < 10 ms, fork < 100 ms, incremental snapshot < 200 ms.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import header  # noqa: E402
from k3.env import Sandbox  # noqa: E402

PEER = {"pause": "< 100 ms", "resume": "< 50 ms", "snapshot, incremental": "133 ms (checkpoint)",
        "restore": "49 ms (resume from checkpoint)"}
TARGET = {"pause": 10, "resume": 10, "fork": 100, "snapshot, incremental": 200}


def timed(fn, repeat: int, setup=None) -> list[float]:
    out = []
    for _ in range(repeat):
        if setup:
            setup()
        t = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t) * 1e3)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mb", type=int, default=100, help="workspace size")
    ap.add_argument("--repeat", type=int, default=10)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="k3bench-"))
    files = {f"data/f{i:03d}.bin": os.urandom(1 << 20) for i in range(args.mb)}
    rows: dict[str, list[float]] = {}

    rows["create, empty"] = timed(lambda: Sandbox.create(root=root).close(), args.repeat)
    rows["create, 100 MB base (incl. writing it)"] = timed(lambda: Sandbox.create(files, root=root).close(),
                                                           max(args.repeat // 3, 2))
    sb = Sandbox.create(files, root=root)
    info = sb.info
    rows["exec round trip (new process tree)"] = timed(lambda: sb.exec("true"), args.repeat)
    sb.shell("true")
    rows["exec round trip (persistent shell)"] = timed(lambda: sb.shell("true"), args.repeat * 5)
    sb.shell("(while :; do :; done) &")
    pause, resume = [], []
    for _ in range(args.repeat * 3):
        pause += timed(sb.pause, 1)
        resume += timed(sb.resume, 1)
    rows["pause"], rows["resume"] = pause, resume
    sb.kill()

    # the 100 MB in the base, 1 MB changed since: fork / snapshot copy the change only
    sb.exec("head -c 1048576 /dev/urandom > changed.bin")
    forks = []
    rows["fork, 100 MB base + 1 MB changed"] = timed(lambda: forks.append(sb.fork()), args.repeat)
    for f in forks:
        f.close()
    rows["snapshot, 100 MB base + 1 MB changed"] = timed(
        sb.snapshot, args.repeat, lambda: (sb.exec("head -c 1048576 /dev/urandom > changed.bin"), time.sleep(0.06)))
    sb.close()

    # the 100 MB written inside the sandbox: all of it in the private layer
    sb = Sandbox.create(root=root)
    sb.exec(f"mkdir data; for i in $(seq {args.mb}); do head -c 1048576 /dev/urandom > data/f$i.bin; done")
    forks = []
    rows["fork, 100 MB written in the sandbox (full copy)"] = timed(lambda: forks.append(sb.fork()),
                                                                    max(args.repeat // 3, 2))
    for f in forks:
        f.close()
    snaps = []
    rows["snapshot, first (100 MB copied)"] = timed(lambda: snaps.append(sb.snapshot()), 1)
    i = [0]

    def change():
        i[0] += 1
        sb.exec(f"head -c 1048576 /dev/urandom > data/f{i[0]}.bin")
        time.sleep(0.06)  # past the 50 ms mtime margin, so unchanged files are linked (workspace.py)

    rows["snapshot, incremental (1 MB changed)"] = timed(lambda: snaps.append(sb.snapshot()), args.repeat, change)
    copied = snaps[-1].copied_bytes
    rows["restore (100 MB snapshot)"] = timed(lambda: sb.restore(snaps[0]), max(args.repeat // 3, 2))
    sb.close()
    os.rmdir(root)

    h = header()
    print(f"commit {h['commit']}, {h['machine']}, {h['date']}; workspace {args.mb} MB, {args.repeat} repeats; "
          f"incremental snapshot copied {copied / 2**20:.1f} MB; sandbox: {info}")
    print("\n| operation | median ms | p90 ms | AgentENV | target |\n|---|---|---|---|---|")
    out = {}
    for name, ts in rows.items():
        ts = sorted(ts)
        med, p90 = statistics.median(ts), ts[min(len(ts) - 1, int(0.9 * len(ts)))]
        key = next((k for k in PEER if name.startswith(k)), None)
        tkey = next((k for k in TARGET if name.startswith(k)), None)
        target = f"< {TARGET[tkey]} ms" if tkey else ""
        print(f"| {name} | {med:.2f} | {p90:.2f} | {PEER.get(key, '') if key else ''} | {target} |")
        out[name] = {"median_ms": med, "p90_ms": p90}
    if args.json:
        Path(args.json).write_text(json.dumps({**h, "rows": out}, indent=1))


if __name__ == "__main__":
    main()
