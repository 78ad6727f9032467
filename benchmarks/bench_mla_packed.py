"""MLA attention over packed documents: documents grouped by length against every document padded to the longest.

Training packs a batch of `--batch-size` samples of `--seq-len` tokens into one row with `cu_seqlens` (as
`k3 train` does); MLA attends causally within each document. ``k3.layers.sequence.mla.attend_documents`` runs
documents of similar length as one padded batch per group (``k3.ops.varlen.length_groups``); the peer is the
former form, every document padded to the longest in one call (``overhead=inf``), the same SDPA kernel.
Both are exact; ``max err`` is their largest output difference. Forward + backward of q, k, v (the projections
around the attention are the same for both and left out), with the `small` preset's MLA shapes (6 heads, q/k
96 channels, v 64) by default, fp32 as training runs MLA (`fp32_attention`).

Document lengths, per `--lengths`:
  corpus  the embedded default data (the standard library's *.py files), tokenized with a byte-level BPE of
          `--vocab-size` learned on it, packed by k3's PackedDataset in its training order;
  short   web-like: log-normal lengths, median 300 tokens (sigma 1.2), packed the same way.
Work: the sum over groups of documents x longest^2, relative to the sum of squared document lengths (ideal 1.0).

    python benchmarks/bench_mla_packed.py                                       # CUDA if present, else CPU
    python benchmarks/bench_mla_packed.py --device cpu --batch-size 2 --batches 3   # a few minutes on 2 cores
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import cpu_time_ms, cuda_time_ms, header  # noqa: E402
from k3 import K3Config  # noqa: E402
from k3.data import encode_documents, stdlib_documents, train_tokenizer  # noqa: E402
from k3.data.packing import PackedDataset  # noqa: E402
from k3.layers.sequence.mla import attend_documents  # noqa: E402
from k3.ops.varlen import GROUP_OVERHEAD, length_groups  # noqa: E402


def document_lengths(kind: str, vocab_size: int, max_bytes: int) -> list[int]:
    if kind == "corpus":
        docs = stdlib_documents(max_bytes)
        tok = train_tokenizer(docs, vocab_size)
        return [len(ids) for ids in encode_documents(tok, docs)]
    if kind == "short":
        rng = random.Random(0)
        return [max(1, int(rng.lognormvariate(math.log(300), 1.2))) for _ in range(5000)]
    raise SystemExit(f"unknown --lengths {kind!r}; choose corpus or short")


def work(lens: list[int], overhead: float) -> float:
    groups = length_groups(lens, overhead)
    return sum(len(g) * lens[g[0]] ** 2 for g in groups) / sum(n * n for n in lens)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="small")
    ap.add_argument("--lengths", default="corpus,short")
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--batch-size", type=int, default=8, help="samples packed into one row, as k3 train does")
    ap.add_argument("--batches", type=int, default=5, help="packed rows timed (the median is reported)")
    ap.add_argument("--vocab-size", type=int, default=32768)
    ap.add_argument("--data-max-bytes", type=int, default=8_000_000)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cuda", "cpu"])
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    cfg = K3Config.preset(args.preset)
    H, Dk, Dv = cfg.num_attention_heads, cfg.qk_nope_head_dim + cfg.qk_rope_head_dim, cfg.v_head_dim
    scale = Dk ** -0.5
    dev = torch.device(args.device)
    timer = (lambda f: cuda_time_ms(f, warmup=2, iters=5)) if dev.type == "cuda" else \
        (lambda f: cpu_time_ms(f, warmup=1, iters=2))
    rows = []
    for kind in args.lengths.split(","):
        lens = document_lengths(kind, args.vocab_size, args.data_max_bytes)
        ds = PackedDataset([[1] * n for n in lens], args.seq_len, eos_id=0, shuffle_seed=0)
        res = {"grouped": [], "one_pad": []}
        docs, works, errs = [], {"grouped": [], "one_pad": []}, []
        for _, batch in zip(range(args.batches), ds.batches(args.batch_size)):
            cu = batch["cu_seqlens"].to(dev)
            T = int(cu[-1])
            doc_lens = (cu[1:] - cu[:-1]).tolist()
            docs.append(len(doc_lens))
            torch.manual_seed(0)
            q, k = (torch.randn(1, H, T, Dk, device=dev, requires_grad=True) for _ in range(2))
            v = torch.randn(1, H, T, Dv, device=dev, requires_grad=True)
            do = torch.randn(1, H, T, Dv, device=dev)
            outs = {}
            for name, overhead in (("grouped", GROUP_OVERHEAD), ("one_pad", float("inf"))):
                def step(overhead=overhead):
                    for x in (q, k, v):
                        x.grad = None
                    o, _ = attend_documents(q, k, v, cu, scale, overhead=overhead)
                    (o * do).sum().backward()
                    return o
                outs[name] = step().detach()
                res[name].append(timer(step))
                works[name].append(work(doc_lens, overhead))
            errs.append((outs["grouped"] - outs["one_pad"]).abs().max().item())
        row = {"lengths": kind, "tokens_per_row": args.batch_size * args.seq_len, "docs_median": statistics.median(docs),
               "work_grouped": statistics.median(works["grouped"]), "work_one_pad": statistics.median(works["one_pad"]),
               "ms_grouped": statistics.median(res["grouped"]), "ms_one_pad": statistics.median(res["one_pad"]),
               "max_err": max(errs)}
        row["speedup"] = row["ms_one_pad"] / row["ms_grouped"]
        rows.append(row)
        print(json.dumps(row), flush=True)
    print(f"\nMLA attention fwd+bwd over packed documents, {args.preset} shapes (H={H}, Dk={Dk}, Dv={Dv}), fp32, "
          f"{args.batch_size} x {args.seq_len} tokens per row, device {args.device}; median of {args.batches} rows\n")
    print("| lengths | documents per row | work, one pad | work, grouped | one pad | grouped | speed-up | max err |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['lengths']} | {r['docs_median']:.0f} | {r['work_one_pad']:.2f}x | {r['work_grouped']:.2f}x | "
              f"{r['ms_one_pad']:.1f} ms | {r['ms_grouped']:.1f} ms | {r['speedup']:.2f}x | {r['max_err']:.1e} |")
    if args.json:
        Path(args.json).write_text(json.dumps({**header(), "args": vars(args), "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
