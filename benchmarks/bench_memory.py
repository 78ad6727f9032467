"""Activation memory per storage policy (k3.train.memory, SPEC §8): what one training step keeps for its backward.

    python benchmarks/bench_memory.py [--preset small] [--batch 1 --seq-len 4096] [--policies keep,efficient,...]
    python benchmarks/bench_memory.py --preset medium --batch 8 --seq-len 4096      # on a GPU

For each policy, a fresh model (same seed, same packed batch of ``--batch`` documents of ``--seq-len`` tokens) runs
one forward and backward (bf16 autocast on CUDA):
  - saved: what the forward left for the backward on the device, measured through the saved-tensor hooks
    (``SavedStats.kept_bytes``: each storage once, weights excluded; deterministic, any device), and what was
    offloaded to host memory;
  - peak (CUDA only): ``torch.cuda.max_memory_allocated`` over the forward and backward, weights, gradients and
    optimiser-free; the "activations" column subtracts what was allocated before the forward;
  - step: forward + backward wall time (recomputation costs time; offloading costs transfers);
  - loss and gradient difference against ``keep`` (0 on CPU: recomputation repeats the same operations).
A policy that runs out of memory is reported as such (the point of the others).
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import header  # noqa: E402
from k3 import K3Config, K3ForCausalLM  # noqa: E402
from k3.train.memory import POLICIES, ActivationManager  # noqa: E402

GIB = 2**30


def one_step(cfg: K3Config, policy: str, ids, cu, device: str) -> dict:
    torch.manual_seed(0)
    model = K3ForCausalLM(cfg).to(device).train()
    manager = ActivationManager(policy)
    manager.attach(model)
    amp = torch.autocast("cuda", dtype=torch.bfloat16) if device == "cuda" else torch.autocast("cpu", enabled=False)
    cuda = device == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    t0 = time.perf_counter()
    with amp, manager.forward() as saved:
        loss = model(ids, cu_seqlens=cu, labels=ids, return_logits=False)["loss"]
    loss.backward()
    if cuda:
        torch.cuda.synchronize()
    step = time.perf_counter() - t0
    row = {"policy": policy, "saved_gib": saved.kept_bytes / GIB, "offloaded_gib": saved.offloaded_bytes / GIB,
           "recompute_inputs_gib": saved.recompute_input_bytes / GIB, "step_s": step, "loss": float(loss)}
    if cuda:
        row["peak_gib"] = torch.cuda.max_memory_allocated() / GIB
        row["activations_peak_gib"] = (torch.cuda.max_memory_allocated() - before) / GIB
    row["grads"] = {n: p.grad.detach().float().cpu() for n, p in model.named_parameters() if p.grad is not None}
    return row


def _innermost_k3_frame(tb) -> str:
    """``file:line function`` of the innermost traceback frame inside the k3 package (or the innermost of all)."""
    frames = traceback.extract_tb(tb)
    ours = [f for f in frames if "/k3/" in f.filename.replace("\\", "/")] or frames
    f = ours[-1]
    return f"{f.filename.rsplit('/k3/', 1)[-1]}:{f.lineno} {f.name}"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="small")
    ap.add_argument("--batch", type=int, default=1, help="documents per step, packed into one row")
    ap.add_argument("--seq-len", type=int, default=4096, help="tokens per document")
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--threads", type=int, default=0, help="CPU intra-op threads (0: torch's default)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = K3Config.preset(args.preset)
    torch.manual_seed(1)
    T = args.batch * args.seq_len
    ids = torch.randint(0, cfg.vocab_size, (1, T), device=args.device)
    cu = torch.arange(0, T + 1, args.seq_len, device=args.device)
    rows, ref = [], None
    for policy in args.policies.split(","):
        try:
            row = one_step(cfg, policy, ids, cu, args.device)
        except torch.OutOfMemoryError as e:  # what was asked for, and where: the next run's first clue
            row = {"policy": policy, "oom": True, "error": str(e).split("\n")[0][:300],
                   "where": _innermost_k3_frame(e.__traceback__)}
        if args.device == "cuda":  # the step's model and activations back to the device before the next policy
            gc.collect()
            torch.cuda.empty_cache()
        if row.get("oom"):
            rows.append(row)
            print(json.dumps(rows[-1]), flush=True)
            continue
        grads = row.pop("grads")
        if ref is None:
            ref = (row["loss"], grads)
        row["loss_diff"] = abs(row["loss"] - ref[0])
        row["grad_max_rel_diff"] = max(((g - ref[1][n]).norm() / ref[1][n].norm().clamp_min(1e-30)).item()
                                       for n, g in grads.items())
        rows.append(row)
        print(json.dumps(row), flush=True)
    out = {**header(), "preset": args.preset, "batch": args.batch, "seq_len": args.seq_len, "rows": rows}
    print(f"\n{args.preset}: {args.batch} x {args.seq_len} tokens, one forward + backward on {args.device} "
          f"(differences against the first policy)")
    print("| policy | saved for backward | offloaded | of which recompute inputs | peak (activations) | step | "
          "loss diff | max grad rel diff |")
    print("|---|---|---|---|---|---|---|---|")
    base = next((r for r in rows if not r.get("oom")), None)
    for r in rows:
        if r.get("oom"):
            print(f"| {r['policy']} | out of memory at {r['where']} | | | | | | |")
            continue
        ratio = f" ({r['saved_gib'] / base['saved_gib']:.2f}x)" if base and base["saved_gib"] else ""
        peak = f"{r['peak_gib']:.2f} GiB ({r['activations_peak_gib']:.2f})" if "peak_gib" in r else "-"
        print(f"| {r['policy']} | {r['saved_gib']:.3f} GiB{ratio} | {r['offloaded_gib']:.3f} GiB | "
              f"{r['recompute_inputs_gib']:.3f} GiB | {peak} | {r['step_s']:.2f} s | {r['loss_diff']:.1e} | "
              f"{r['grad_max_rel_diff']:.1e} |")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
