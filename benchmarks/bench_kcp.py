"""Context parallelism for KDA across GPUs: k3's KCP against fla-core's own CP, one long sequence split over R ranks.

Single-sequence KDA (B=1, one document of T tokens), bf16 q/k/v, fp32 gates in (-5, 0), ``lower_bound=-5`` (fla's
safe-gate path), T cut into R equal contiguous slices, one per rank; both behind the GLOBAL interface
``k3.distributed.kcp.cp_chunk_kda``:
  kcp     impl="k3": fla's chunk_kda for the local chunks (``backend="auto"``): one call with V+K value columns
          gives the segment map [M | S~] and the outputs' sensitivity to the carried state; one all-gather of
          [M | S~], the scan for the cross-rank state, o = o~ + P S_in (one more all-gather in the backward);
  fla_cp  impl="fla": ``fla.ops.cp.build_cp_context`` + ``fla.ops.kda.chunk_kda(..., cp_context=...)``;
  fla     with R=1 only: plain chunk_kda on the whole sequence (the one-GPU baseline).
Forward (prefill, no grad) and forward+backward (training); CUDA-event medians after warm-up (which absorbs fla's
autotuning), the slowest rank's; tokens/s counts all T tokens. ``rel err``: RMS relative error of o against kcp
(against fla with R=1) on every rank's slice (its first 16K tokens and every 61st token after them), the worst
rank's.

    torchrun --nproc_per_node 2 benchmarks/bench_kcp.py [--json out.json]     # H200s: T 256K and 1M, H 16, D 128
    torchrun --nproc_per_node 1 benchmarks/bench_kcp.py                       # the one-GPU baseline (or plain python)
    torchrun --nproc_per_node 2 benchmarks/bench_kcp.py --shapes T1048576-H96-D128   # more heads, if memory allows
    torchrun --nproc_per_node 2 benchmarks/bench_kcp.py --device cpu --shapes T256-H2-D16   # smoke run (gloo)
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import cpu_time_ms, cuda_time_ms, header, kda_inputs, rel_rms  # noqa: E402
from k3.distributed.kcp import cp_chunk_kda, equal_split  # noqa: E402
from k3.ops.kda import resolve_backend  # noqa: E402
from k3.ops.kda.cp import chunk_kda_any  # noqa: E402
from k3.ops.kda.fla import fla_cp_available  # noqa: E402

DEFAULT_SHAPES = "T262144-H16-D128,T1048576-H16-D128"
IMPLS = ("kcp", "fla_cp", "fla")
LOWER_BOUND = -5.0


def parse(shape: str):
    d = dict((p[0], int(p[1:])) for p in shape.split("-"))
    if d.get("B", 1) != 1:
        raise SystemExit(f"{shape}: KCP benchmarks one packed sequence (B1)")
    return d["T"], d["H"], d["D"]


def setup(device: str):
    """torch.distributed from torchrun's environment; a plain ``python`` run is a one-rank group."""
    if "RANK" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    timeout = datetime.timedelta(minutes=10)  # a rank that dies (OOM) ends the others' collectives, not a hang
    if device == "cuda":
        local = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local)
        dist.init_process_group("nccl", timeout=timeout, device_id=torch.device("cuda", local))
    else:
        dist.init_process_group("gloo", timeout=timeout)
    return dist.get_rank(), dist.get_world_size()


def all_max(x: float, device) -> float:
    """The maximum over ranks; NaN (OOM, error) on any rank gives NaN."""
    t = torch.tensor([-1.0 if x != x else x, float(x != x)], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float("nan") if t[1].item() else t[0].item()


def make_fn(impl, cu, backend):
    if impl == "fla":
        return lambda *xs: chunk_kda_any(*xs, lower_bound=LOWER_BOUND, backend=backend)[0]
    return lambda *xs: cp_chunk_kda(*xs, cu, lower_bound=LOWER_BOUND, impl="k3" if impl == "kcp" else "fla",
                                    backend=backend)


def bench_shape(shape, impls, modes, device, rank, world, warmup, iters):
    T, H, D = parse(shape)
    start, end = equal_split(T, world, rank)
    torch.manual_seed(1000 + rank)  # each rank draws its own slice of the global sequence
    xs = kda_inputs(1, end - start, H, D, device, requires_grad=True)
    do = torch.randn_like(xs[2])
    cu = torch.tensor([0, T], device=device)  # one document; one tensor object, so fla caches its CP context
    backend = "auto" if device == "cuda" else "torch"
    rows, outs = [], {}

    def timer(fn, bwd):
        if device == "cuda":
            return cuda_time_ms(fn, warmup=warmup, iters=max(2, iters // 2) if bwd else iters)
        return cpu_time_ms(fn, warmup=1, iters=max(1, iters // 3))

    for impl in impls:
        row = {"shape": shape, "R": world, "impl": impl}
        if impl == "fla" and world > 1:
            continue  # the whole sequence on one GPU: the R=1 baseline only
        if impl == "fla_cp" and not fla_cp_available(xs[0]):
            row["skipped"] = "fla-core's CP needs fla-core on CUDA"
            rows.append(row)
            continue
        row["kernels"] = "fla" if impl == "fla_cp" else resolve_backend(backend, xs[0])
        fn = make_fn(impl, cu, backend)

        def fwd():
            with torch.no_grad():
                return fn(*xs)

        def fwd_bwd():
            for x in xs:
                x.grad = None
            fn(*xs).backward(do)

        try:
            o = fwd()
            # rel err on a sample (all outputs of every impl would not fit next to each other at 1M tokens, 96 heads):
            # the slice's first tokens, where the carried state matters most, and every 61st token after them
            outs[impl] = torch.cat([o[:, :16384], o[:, 16384::61]], dim=1).clone()
            del o
            for mode, f in (("fwd", fwd), ("fwdbwd", fwd_bwd)):
                if mode in modes:
                    row[f"{mode}_ms"] = timer(f, mode == "fwdbwd")
        except torch.OutOfMemoryError:  # the ranks hold equal slices: they run out together
            row["oom"] = True
        except Exception as e:  # noqa: BLE001 - e.g. an input fla rejects: raised on every rank alike
            row["error"] = f"{type(e).__name__}: {e}"[:300]
        finally:
            if device == "cuda":
                torch.cuda.empty_cache()
        rows.append(row)
        if rank == 0:  # progress (this rank's times), so a run stopped at its limit still says how far it got
            print(f"# {shape} R={world} {impl}: " + json.dumps({k: v for k, v in row.items() if k.endswith("ms") or k in ("oom", "error")}),
                  file=sys.stderr, flush=True)
    ref = outs.get("fla" if world == 1 else "kcp")
    for row in rows:
        if "skipped" in row:
            continue
        for mode in modes:
            ms = all_max(row.get(f"{mode}_ms", float("nan")), device)
            row[f"{mode}_ms"], row[f"{mode}_tok_s"] = ms, T / (ms / 1e3) if ms == ms else float("nan")
        err = rel_rms(ref, outs[row["impl"]]) if ref is not None and row["impl"] in outs else float("nan")
        row["rel_err"] = all_max(err, device)
    xs = do = outs = None  # noqa: F841 - free before the next shape
    if device == "cuda":
        torch.cuda.empty_cache()
    return rows


def fmt(ms, tok_s):
    if ms != ms:
        return "OOM/err"
    return f"{ms:.2f} ms ({tok_s / 1e6:.2f} M tok/s)" if tok_s >= 1e6 else f"{ms:.2f} ms ({tok_s / 1e3:.1f} k tok/s)"


def markdown(rows, modes):
    names = {"fwd": "forward (prefill)", "fwdbwd": "forward+backward (training)"}
    lines = ["| shape | R | impl | kernels | " + " | ".join(names[m] for m in modes) + " | rel err |",
             "|---" * (len(modes) + 5) + "|"]
    for r in rows:
        if "skipped" in r:
            cells = ["-"] * len(modes) + [r["skipped"]]
        else:
            ref = r["impl"] == ("fla" if r["R"] == 1 else "kcp")
            cells = [fmt(r[f"{m}_ms"], r[f"{m}_tok_s"]) for m in modes] + ["ref" if ref else f"{r['rel_err']:.1e}"]
        lines.append(f"| {r['shape']} | {r['R']} | {r['impl']} | {r.get('kernels', '-')} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default=DEFAULT_SHAPES, help="comma-separated T<tokens>-H<heads>-D<head dim>")
    ap.add_argument("--impls", default=",".join(IMPLS), help=f"comma-separated, of {IMPLS}")
    ap.add_argument("--modes", default="fwd,fwdbwd", help="fwd (prefill) and/or fwdbwd (training)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cuda", "cpu"])
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--iters", type=int, default=10, help="timed forward calls (forward+backward: half)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda needs a CUDA device; use --device cpu with small --shapes for a smoke run")
    impls, modes = args.impls.split(","), args.modes.split(",")
    if bad := set(impls) - set(IMPLS) or set(modes) - {"fwd", "fwdbwd"}:
        raise SystemExit(f"unknown impls/modes {sorted(bad)}")
    rank, world = setup(args.device)
    head = {**header(), "ranks": world, "device": args.device}
    if rank == 0:
        print(json.dumps(head), flush=True)
    rows = []
    try:
        for shape in args.shapes.split(","):
            new = bench_shape(shape, impls, modes, args.device, rank, world, args.warmup, args.iters)
            rows += new
            if rank == 0:
                for r in new:
                    print(json.dumps(r), flush=True)
                if args.json:
                    Path(args.json).write_text(json.dumps({**head, "rows": rows}, indent=2))
        if rank == 0:
            print(f"\nKDA context parallelism over {world} rank(s), one sequence of T tokens; cells: time of the "
                  "slowest rank (all T tokens per second)\n")
            print(markdown(rows, modes))
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
