"""Where a profiled training step's device time goes, from a torch.profiler chrome trace (``bench_train.py
--profile DIR --trace`` writes DIR/<row>.json.gz).

    python benchmarks/trace_report.py runs/profile/k3-small-uniform.json.gz [--top 40] [--steps 1]

Every kernel is charged to the phase its launch ran in (the optimiser: inside an ``Optimizer.step`` range;
the backward: inside an autograd engine node, named by the node; else the forward, named by the innermost module
range ``fwd::<class>`` of ``bench_train.py``'s hooks) and to the innermost op that launched it. Prints the device
time per phase, per (phase, module or autograd node), per launching op and per kernel name, largest first; times
are per step (divided by ``--steps``, the number of steps in the profiled window).
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json


def load(path: str) -> list[dict]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        return json.load(f)["traceEvents"]


def stacks(ranges: list[dict], times: list[float]) -> list[list[dict]]:
    """For each time of ``times`` (sorted), the ranges of one thread (sorted by start; properly nested) that contain
    it, outermost first: one sweep with a stack."""
    out, stack, i = [], [], 0
    for ts in times:
        while i < len(ranges) and ranges[i]["ts"] <= ts:
            r = ranges[i]
            while stack and stack[-1]["ts"] + stack[-1]["dur"] < r["ts"]:
                stack.pop()
            stack.append(r)
            i += 1
        while stack and stack[-1]["ts"] + stack[-1]["dur"] < ts:
            stack.pop()
        out.append([r for r in stack if r["ts"] + r["dur"] >= ts])
    return out


def attribute(events: list[dict]):
    """-> list of (kernel name, dur us, phase, owner, launching op) for every device kernel."""
    ranges = collections.defaultdict(list)
    for e in events:
        if e.get("ph") == "X" and e.get("cat") in ("cpu_op", "user_annotation"):
            ranges[e["tid"]].append(e)
    launches = {e["args"]["correlation"]: e for e in events
                if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})}
    by_launch = {}
    for tid, rs in ranges.items():
        rs.sort(key=lambda r: (r["ts"], -r["dur"]))
        mine = sorted((e for e in launches.values() if e["tid"] == tid), key=lambda e: e["ts"])
        for e, st in zip(mine, stacks(rs, [e["ts"] for e in mine])):
            by_launch[e["args"]["correlation"]] = st
    out = []
    for k in events:
        if k.get("cat") not in ("kernel", "gpu_memcpy", "gpu_memset"):
            continue
        stack = by_launch.get(k["args"].get("correlation"), [])
        names = [r["name"] for r in stack]
        phase, owner = "forward", "?"
        if any(n.startswith("Optimizer.step") or n.startswith("Optimizer.zero_grad") for n in names):
            phase = "optimizer"
            owner = next(n for n in names if n.startswith("Optimizer."))
        elif any(n.startswith("autograd::engine::evaluate_function") for n in names):
            phase = "backward"
            owner = [n for n in names if n.startswith("autograd::engine::evaluate_function")][-1].split(": ", 1)[-1]
        else:
            mods = [n[5:] for n in names if n.startswith("fwd::")]
            owner = mods[-1] if mods else "outside modules"
        ops = [n for n in names if n.startswith(("aten::", "triton", "## Call", "_", "k3::")) or "Function" in n]
        op = ops[-1] if ops else (names[-1] if names else "?")
        if op.startswith("## Call CompiledFxGraph"):
            op = "compiled graph"
        out.append((k["name"], k["dur"], phase, owner, op))
    return out


def report(rows, steps: int, top: int) -> str:
    total = sum(r[1] for r in rows) / steps
    lines = [f"device time per step: {total / 1e3:.2f} ms in {len(rows) // steps} kernels/copies"]

    def table(title, key):
        agg, cnt = collections.Counter(), collections.Counter()
        for r in rows:
            agg[key(r)] += r[1]
            cnt[key(r)] += 1
        lines.append(f"\n{title}:")
        for name, us in agg.most_common(top):
            ms, share = us / steps / 1e3, us / steps / total
            lines.append(f"  {ms:8.2f} ms {share:6.1%} x{cnt[name] // steps:<5} {str(name)[:150]}")

    table("by phase", lambda r: r[2])
    table("by phase and module / autograd node", lambda r: (r[2], r[3]))
    table("by phase and launching op", lambda r: (r[2], r[4]))
    table("by kernel", lambda r: r[0][:120])
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("trace")
    ap.add_argument("--top", type=int, default=40)
    ap.add_argument("--steps", type=int, default=1, help="steps in the profiled window (times are per step)")
    args = ap.parse_args()
    print(report(attribute(load(args.trace)), args.steps, args.top))


if __name__ == "__main__":
    main()
