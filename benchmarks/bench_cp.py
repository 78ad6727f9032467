"""Intra-device context parallelism for KDA prefill (SPEC §8): one long sequence through chunk_kda whole, against the
same sequence cut into R segments run side by side on one device (``k3.ops.kda.cp.intra_device_cp_kda``: one
chunk_kda call over all segments at once with V+K value columns (outputs from the zero state, their sensitivity P
to the initial state, and each segment's (M, S~)), a prefix scan of R [K,K] @ [K,V] products, then o~ + P S_in for
every token). Forward only
(prefill), bf16 q/k/v, fp32 gates in (-5, 0), ``backend="auto"`` (fla-core's Triton chunk_kda on CUDA when it imports).

    python benchmarks/bench_cp.py                      # H200: T 256K and 1M, H 16 and 96, D 128, R = 4..64
    python benchmarks/bench_cp.py --device cpu --shapes B1-T2048-H2-D32 --segments 2,4 --dtype fp32   # smoke run

Why it could win: fla's inter-chunk state pass walks T/64 chunks in sequence with one program per (sequence, head, V
block); R segments give R times the programs, for more arithmetic (V+K value columns, then one [K] x [K,V]
product per token and head). Measured on the H200 with fla-core 0.6.0 (benchmarks/RESULTS.md), the earlier form
(a summary pass with V+K columns, then a second full output pass) did not win: 0.52-0.54x at 256K and 1M tokens,
H=16, for every R from 4 to 64; fla's kernel is already parallel enough there. The one-pass form is not yet
measured on a GPU.

fla-core's own context parallelism (``fla.ops.cp.build_cp_context(cu_seqlens, group)`` and the ``cp_context``
argument of its ``chunk_kda``) splits a sequence across the ranks of a torch.distributed process group; in one
process the group has one rank and the call is the plain kernel, so there is no one-process comparison with it
here: ``benchmarks/bench_kcp.py`` compares it with k3's KCP (``k3.distributed.kcp``) across GPUs under torchrun.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import cpu_time_ms, cuda_time_ms, header, kda_inputs, rel_rms  # noqa: E402
from k3.ops.kda import resolve_backend  # noqa: E402
from k3.ops.kda.cp import chunk_kda_any, intra_device_cp_kda  # noqa: E402

DEFAULT_SHAPES = "B1-T262144-H16-D128,B1-T262144-H96-D128,B1-T1048576-H16-D128,B1-T1048576-H96-D128"
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def parse(shape: str):
    d = dict((p[0], int(p[1:])) for p in shape.split("-"))
    return d["B"], d["T"], d["H"], d["D"]


def bench_shape(shape, segments, device, dtype, backend):
    B, T, H, D = parse(shape)
    timer = cuda_time_ms if device == "cuda" else cpu_time_ms
    row = {"shape": shape, "whole_ms": float("nan"), "segments": {}, "max_rel_err": float("nan")}
    try:
        xs = kda_inputs(B, T, H, D, device, dtype)
        row["backend"] = resolve_backend(backend, xs[0])
        with torch.no_grad():
            o_whole, _ = chunk_kda_any(*xs, lower_bound=-5.0, backend=backend)
            row["whole_ms"] = timer(lambda: chunk_kda_any(*xs, lower_bound=-5.0, backend=backend))
            errs = []
            for R in segments:
                try:
                    o_cp, _ = intra_device_cp_kda(*xs, R, lower_bound=-5.0, backend=backend)
                    errs.append(rel_rms(o_whole, o_cp))
                    del o_cp
                    row["segments"][R] = timer(lambda: intra_device_cp_kda(*xs, R, lower_bound=-5.0, backend=backend))
                except torch.OutOfMemoryError:
                    row["segments"][R] = float("nan")
                if device == "cuda":
                    torch.cuda.empty_cache()
            row["max_rel_err"] = max(errs, default=float("nan"))
    except torch.OutOfMemoryError:
        row["oom"] = True
    finally:
        xs = o_whole = None  # noqa: F841 - free before the next shape
        if device == "cuda":
            torch.cuda.empty_cache()
    return row


def markdown(rows, segments):
    lines = ["| shape | backend | whole chunk_kda | " + " | ".join(f"R={R}" for R in segments) + " | max rel err |",
             "|---" * (len(segments) + 4) + "|"]
    for r in rows:
        w = r["whole_ms"]
        cells = []
        for R in segments:
            t = r["segments"].get(R, float("nan"))
            cells.append("OOM" if t != t else f"{t:.1f} ms ({w / t:.2f}x)")
        whole = "OOM" if w != w else f"{w:.1f} ms"
        lines.append(f"| {r['shape']} | {r.get('backend', '-')} | {whole} | " + " | ".join(cells)
                     + f" | {r['max_rel_err']:.1e} |")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default=DEFAULT_SHAPES)
    ap.add_argument("--segments", default="4,8,16,32,64", help="comma-separated segment counts R")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cuda", "cpu"])
    ap.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    ap.add_argument("--backend", default="auto", choices=["auto", "torch", "fla"])
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda needs a CUDA device; use --device cpu with small --shapes for a smoke run")
    segments = [int(s) for s in args.segments.split(",")]
    rows = []
    for shape in args.shapes.split(","):
        rows.append(bench_shape(shape, segments, args.device, DTYPES[args.dtype], args.backend))
        print(json.dumps(rows[-1]), flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps({**header(), "rows": rows}, indent=2))
    print("\nintra-device CP, forward (prefill); cells: time (whole / CP speed-up)\n")
    print(markdown(rows, segments))


if __name__ == "__main__":
    main()
