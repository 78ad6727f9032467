"""The optimiser step of K3 models (Muon for the matrices, AdamW for the rest; SPEC §5): its time per step, with
Muon's elementwise passes fused (``k3.ops.muon_step``, the default on CUDA) and unfused (the torch-op reference), in
one run, and the bytes the fused step must move at least against the time it takes.

    python benchmarks/bench_muon.py [--presets small,medium] [--json out.json]

Each row: the model's parameters on the GPU (fp32, as in training), random gradients, then the combined
optimiser's ``step()`` timed with CUDA events (median of ``--iters`` after ``--warmup``). "floor" is the Muon step's
elementwise traffic at the H200's ~4.8 TB/s (read gradient, momentum and weight, write momentum and weight, write
and read the bf16 batch: 26 bytes per element) plus nothing for Newton-Schulz, whose GEMMs are compute-bound.
"unfused" also runs Newton-Schulz's normalisation and a I + b G as torch ops. Then, fused, the step with gradient
clipping: torch's ``clip_grad_norm_`` (a norm pass and a pass scaling every gradient) then ``step()``, against
``clip_coefficient`` and ``step(scale=...)`` (the factor read inside the step's passes, as ``k3 train`` runs it).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from benchmarks.common import cuda_time_ms, header  # noqa: E402
from k3 import K3Config, K3ForCausalLM  # noqa: E402
import k3.ops.muon_step as muon_step  # noqa: E402
from k3.train.optim import build_optimizer, clip_coefficient  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--presets", default="small,medium")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_muon.py times CUDA kernels: run it on a GPU")
    rows = []
    print("| preset | Muon params | AdamW params | unfused ms | fused ms | unfused / fused | floor ms | clip_grad_norm_ + "
          "step ms | clipping folded ms |")
    print("|---|---|---|---|---|---|---|---|---|")
    for preset in args.presets.split(","):
        torch.manual_seed(0)
        with torch.device("cuda"):
            model = K3ForCausalLM(K3Config.preset(preset))
        opt = build_optimizer(model, lr=1e-4)
        for p in model.parameters():
            p.grad = torch.randn_like(p) * 1e-3
        n_muon = sum(p.numel() for g in opt.optimizers["muon"].param_groups for p in g["params"])
        n_adam = sum(p.numel() for g in opt.optimizers["adamw"].param_groups for p in g["params"])
        times = {}
        real = muon_step.fused_applies
        for name, applies in (("unfused", lambda t: False), ("fused", real)):
            muon_step.fused_applies = applies
            try:
                times[name] = cuda_time_ms(opt.step, warmup=args.warmup, iters=args.iters)
            finally:
                muon_step.fused_applies = real
        params = list(model.parameters())

        def clip_then_step():  # torch's clipping: a norm pass, then a pass multiplying every gradient
            torch.nn.utils.clip_grad_norm_(params, 1e-6)  # always clipping (the gradients shrink each call)
            opt.step()

        def folded():  # the norm pass, the factor read inside the step's own passes (what k3 train runs)
            opt.step(scale=clip_coefficient(params, 1e-6)[1])

        times["clip_then_step"] = cuda_time_ms(clip_then_step, warmup=args.warmup, iters=args.iters)
        times["clip_folded"] = cuda_time_ms(folded, warmup=args.warmup, iters=args.iters)
        floor = n_muon * 26 / 4.8e12 * 1e3
        row = dict(preset=preset, muon_params=n_muon, adamw_params=n_adam, unfused_ms=times["unfused"],
                   fused_ms=times["fused"], floor_ms=floor, clip_then_step_ms=times["clip_then_step"],
                   clip_folded_ms=times["clip_folded"])
        rows.append(row)
        print(f"| {preset} | {n_muon / 1e6:.0f}M | {n_adam / 1e6:.0f}M | {times['unfused']:.1f} | "
              f"{times['fused']:.1f} | {times['unfused'] / times['fused']:.2f}x | {floor:.1f} | "
              f"{times['clip_then_step']:.1f} | {times['clip_folded']:.1f} |", flush=True)
        del model, opt
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**header(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
