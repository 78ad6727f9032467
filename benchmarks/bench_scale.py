"""Training throughput of `k3 train` on several devices against one (scaling efficiency), in one run.

    python benchmarks/bench_scale.py [--preset small] [--gpus 2] [--seq-len 4096] [--batch-size 4] [--steps 12]
                                     [--layouts one,dp,ep,cp,dpxep] [--json out.json]
    python benchmarks/bench_scale.py --device cpu --preset tiny --seq-len 128 --steps 4 --gpus 2   # smoke (gloo)

Each layout is a real `k3 train` run (`torchrun --nproc_per_node N -m k3 train ...` for N > 1) on the embedded
standard-library corpus, with the same per-rank batch (`--batch-size` sequences of `--seq-len` tokens):
  one    1 device, the baseline;
  graph  1 device with --cuda-graph (cuda only): the fastest one-device step, for reference (not a baseline: the
         step of several processes cannot be captured);
  dp     --dp N   (FSDP2): N x the tokens per step;
  ep     --ep N   (MoonEP experts, each rank its own slice): N x the tokens per step;
  cp     --cp N   (KCP: each sequence split along time over the N devices): the same tokens per step as one
         device, each device holds 1/N of every sequence (what CP is for: sequences too long for one device);
  dpxep  --dp 2 --ep N/2 (needs N >= 4).
Every layout runs the same step: regional ``--compile`` on CUDA (``--no-compile`` for the eager step), no CUDA
graph (a captured step is one process's: ``--cuda-graph`` refuses torchrun), ``--memory-policy keep``.
Throughput is the median of the per-step `tokens_per_s` that `k3 train` logs (all ranks' tokens), after
``--warmup`` steps; per device = that / N; scaling efficiency = per-device tokens/s / the one-device run's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import header  # noqa: E402

LAYOUTS = {"one": (1, []), "graph": (1, ["--cuda-graph"]), "dp": (None, ["--dp", "{n}"]), "ep": (None, ["--ep", "{n}"]),
           "cp": (None, ["--cp", "{n}"]), "dpxep": (None, ["--dp", "2", "--ep", "{half}"])}


def run_layout(name: str, n: int, args, out: Path) -> dict:
    procs, extra = LAYOUTS[name]
    procs = procs or n
    extra = [x.format(n=n, half=n // 2) for x in extra]
    if name == "dpxep" and (n < 4 or n % 2):
        return {"layout": name, "devices": n, "skipped": "needs an even number of devices >= 4"}
    train = ["--preset", args.preset, "--steps", str(args.steps), "--seq-len", str(args.seq_len),
             "--batch-size", str(args.batch_size), "--data-max-bytes", str(args.data_max_bytes),
             "--vocab-size", str(args.vocab_size), "--eval-every", str(10 ** 9), "--save-every", str(10 ** 9),
             "--log-every", "1", "--device", args.device, "--memory-policy", args.memory_policy,
             "--out", str(out / name)] + (["--compile"] if args.compile else []) + extra
    launcher = [sys.executable, "-m", "k3", "train"] if procs == 1 else \
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(procs), "-m", "k3", "train"]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1" if args.device == "cpu" else "8")}
    r = subprocess.run(launcher + train, capture_output=True, text=True, env=env, timeout=args.timeout)
    row = {"layout": name, "devices": procs, "flags": " ".join(extra)}
    if r.returncode != 0:
        row["error"] = (r.stdout + r.stderr)[-1500:]
        return row
    recs = [json.loads(line) for line in (out / name / "metrics.jsonl").read_text().splitlines()]
    rates = [x["tokens_per_s"] for x in recs if x["step"] > args.warmup and "val_loss" not in x]
    if not rates:
        row["error"] = f"no step after --warmup {args.warmup} (ran {len(recs)} steps)"
        return row
    row["tokens_per_s"] = statistics.median(rates)
    row["tokens_per_s_per_device"] = row["tokens_per_s"] / procs
    row["tokens_per_step"] = recs[-1]["tokens"] // recs[-1]["step"]
    row["final_loss"] = recs[-1]["loss"]
    return row


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="small")
    ap.add_argument("--gpus", type=int, default=2, help="devices for the multi-device layouts")
    ap.add_argument("--layouts", default="one,dp,ep,cp,dpxep")
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--batch-size", type=int, default=4, help="sequences per rank per step")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--vocab-size", type=int, default=32768)
    ap.add_argument("--data-max-bytes", type=int, default=8_000_000)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                    help="every layout with --compile (regional torch.compile); default: on for cuda, off for cpu")
    ap.add_argument("--memory-policy", default="keep", help="k3 train's --memory-policy for every layout")
    ap.add_argument("--timeout", type=int, default=600, help="seconds per layout")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.compile is None:
        args.compile = args.device == "cuda"
    layouts = args.layouts.split(",")
    unknown = [x for x in layouts if x not in LAYOUTS]
    if unknown:
        ap.error(f"unknown layouts {unknown}; choose from {list(LAYOUTS)}")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in layouts:
            rows.append(run_layout(name, args.gpus, args, Path(tmp)))
            print(json.dumps({k: v for k, v in rows[-1].items() if k != "error"}), flush=True)
            if "error" in rows[-1]:
                print(rows[-1]["error"], file=sys.stderr, flush=True)
    base = next((r["tokens_per_s_per_device"] for r in rows if r["layout"] == "one" and "tokens_per_s" in r), None)
    print(f"\n{args.preset}, {args.batch_size} x {args.seq_len} tokens per rank per step, device {args.device}, "
          f"compile {'on' if args.compile else 'off'}, memory policy {args.memory_policy}")
    print("| layout | devices | tokens/step | tokens/s | per device | scaling efficiency |\n|---|---|---|---|---|---|")
    for r in rows:
        if "tokens_per_s" not in r:
            print(f"| {r['layout']} | {r['devices']} | - | {r.get('skipped', 'failed')} | - | - |")
            continue
        eff = f"{r['tokens_per_s_per_device'] / base:.2f}" if base else "-"
        r["scaling_efficiency"] = r['tokens_per_s_per_device'] / base if base else None
        print(f"| {r['layout']} {r['flags']} | {r['devices']} | {r['tokens_per_step']:,} | {r['tokens_per_s']:,.0f} | "
              f"{r['tokens_per_s_per_device']:,.0f} | {eff} |")
    if args.json:
        Path(args.json).write_text(json.dumps({**header(), "args": vars(args), "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
