"""Peak memory of the training loss: the full [tokens, vocab] logits against the chunked LM loss (SPEC §7,
``k3.ops.linear_ce``), one forward + backward each, on the CPU.

    python benchmarks/bench_loss_memory.py [--preset tiny] [--vocab-size 32768] [--tokens 4096] [--json out.json]

Each mode runs in its own process (``model(..., return_logits=True)``, then ``return_logits=False``) and reports
its peak resident memory (``ru_maxrss``: the whole process, libraries included) and its loss, which must agree.
The chunked loss computes each 4,096-token chunk's loss and its gradients in the forward: the logits of one chunk
and one fp32 temporary are the most it holds at once.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import header  # noqa: E402


def one(mode: str, preset: str, vocab: int, tokens: int) -> dict:
    import torch

    from k3 import K3Config, K3ForCausalLM

    torch.manual_seed(0)
    model = K3ForCausalLM(K3Config.preset(preset).replace(vocab_size=vocab)).train()
    x = torch.randint(0, vocab, (1, tokens))
    out = model(x, labels=x, return_logits=mode == "full")
    out["loss"].backward()
    return {"mode": mode, "loss": out["loss"].item(),
            "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}  # KiB on Linux


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--vocab-size", type=int, default=32768)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--json", default=None)
    ap.add_argument("--mode", choices=["full", "chunked"], help=argparse.SUPPRESS)  # one child process
    args = ap.parse_args()
    if args.mode:
        print(json.dumps(one(args.mode, args.preset, args.vocab_size, args.tokens)))
        return
    rows = []
    for mode in ("full", "chunked"):
        cmd = [sys.executable, __file__, "--mode", mode, "--preset", args.preset, "--vocab-size",
               str(args.vocab_size), "--tokens", str(args.tokens)]
        rows.append(json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.splitlines()[-1]))
        print(json.dumps(rows[-1]), flush=True)
    full, chunked = rows
    print(f"\n{args.preset}, vocab {args.vocab_size}, {args.tokens} tokens: peak {full['peak_rss_gib']:.2f} GiB with the "
          f"full logits, {chunked['peak_rss_gib']:.2f} GiB chunked; loss {full['loss']:.6f} / {chunked['loss']:.6f}")
    if abs(full["loss"] - chunked["loss"]) > 1e-4 * abs(full["loss"]):
        raise SystemExit("the chunked loss differs from the full one")
    if args.json:
        Path(args.json).write_text(json.dumps({**header(), "args": vars(args), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
