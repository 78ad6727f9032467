"""Packed documents without padding waste, against padding every document to the longest: MLA, KDA, short conv.

Training packs a batch of `--batch-size` samples of `--seq-len` tokens into one row with `cu_seqlens` (as
`k3 train` does); attention and the KDA recurrence never cross a document. Two paths are measured, each against
its padded form on the same rows (`--ops`):
  mla  ``k3.layers.sequence.mla.attend_documents``: documents of similar length run as one padded batch per
       group (``k3.ops.varlen.length_groups``); peer: every document padded to the longest in one SDPA call
       (``overhead=inf``). The `small` preset's MLA shapes (6 heads, q/k 96, v 64), fp32 as training runs MLA.
       ``work``: the sum over groups of documents x longest^2 over the sum of squared lengths (1.0: no padding).
  kda  ``k3.ops.kda.reference.chunk_kda`` (the pure-torch reference, the CPU path): documents in length groups
       (count x longest, in 64-token chunks); peer: every document padded to the longest in one batch
       (``group_overhead=inf``). The `small` preset's KDA shapes, fp32 inputs. ``work``: the padded tokens over
       the row's tokens.
  conv ``k3.ops.short_conv.short_conv`` (KDA's q/k/v convolution, width 4): no padding at all, the taps as
       shifted copies of the row masked at document starts; peer: every document padded to the longest
       (``k3.ops.varlen.pack_sequences``), one depthwise ``conv1d``, unpadded. The `small` preset's q width
       (heads x head dim). ``work``: the padded tokens over the row's tokens.
Forward + backward of the op alone; both forms are exact, ``max err`` is their largest output difference.

Document lengths, per `--lengths`:
  corpus  the embedded default data (the standard library's *.py files), tokenized with a byte-level BPE of
          `--vocab-size` learned on it, packed by k3's PackedDataset in its training order;
  short   web-like: log-normal lengths, median 300 tokens (sigma 1.2), packed the same way.

    python benchmarks/bench_packed.py                                          # CUDA if present, else CPU
    python benchmarks/bench_packed.py --device cpu --batch-size 1 --batches 3  # a few minutes on 2 cores
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
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import cpu_time_ms, cuda_time_ms, header  # noqa: E402
from k3 import K3Config  # noqa: E402
from k3.data import encode_documents, stdlib_documents, train_tokenizer  # noqa: E402
from k3.data.packing import PackedDataset  # noqa: E402
from k3.layers.sequence.mla import attend_documents  # noqa: E402
from k3.ops.kda.reference import GROUP_OVERHEAD_CHUNKS, chunk_kda  # noqa: E402
from k3.ops.short_conv import short_conv  # noqa: E402
from k3.ops.varlen import GROUP_OVERHEAD, length_groups, pack_sequences, unpack_sequences  # noqa: E402


def document_lengths(kind: str, vocab_size: int, max_bytes: int) -> list[int]:
    if kind == "corpus":
        docs = stdlib_documents(max_bytes)
        tok = train_tokenizer(docs, vocab_size)
        return [len(ids) for ids in encode_documents(tok, docs)]
    if kind == "short":
        rng = random.Random(0)
        return [max(1, int(rng.lognormvariate(math.log(300), 1.2))) for _ in range(5000)]
    raise SystemExit(f"unknown --lengths {kind!r}; choose corpus or short")


def mla_case(cfg, T, dev):
    """(inputs, {form: fn(inputs, cu) -> output}, {form: work(lens)}) for MLA attention."""
    H, Dk, Dv = cfg.num_attention_heads, cfg.qk_nope_head_dim + cfg.qk_rope_head_dim, cfg.v_head_dim
    xs = [torch.randn(1, H, T, d, device=dev, requires_grad=True) for d in (Dk, Dk, Dv)]

    def run(overhead):
        return lambda xs, cu: attend_documents(*xs, cu, Dk ** -0.5, overhead=overhead)[0]

    def work(overhead):
        return lambda lens: sum(len(g) * lens[g[0]] ** 2 for g in length_groups(lens, overhead)) / \
            sum(n * n for n in lens)

    return xs, {"now": run(GROUP_OVERHEAD), "padded": run(float("inf"))}, \
        {"now": work(GROUP_OVERHEAD), "padded": work(float("inf"))}


def kda_case(cfg, T, dev):
    """The same for the pure-torch KDA reference (the padded peer is the path taken when final states are asked)."""
    H, K = cfg.kda_num_heads, cfg.kda_head_dim
    q, v = torch.randn(1, T, H, K, device=dev), torch.randn(1, T, H, K, device=dev)
    k = torch.nn.functional.normalize(torch.randn(1, T, H, K, device=dev), dim=-1)
    g, beta = -5.0 * torch.rand(1, T, H, K, device=dev), torch.rand(1, T, H, device=dev)
    xs = [x.requires_grad_() for x in (q, k, v, g, beta)]
    forms = {"now": lambda xs, cu: chunk_kda(*xs, cu_seqlens=cu)[0],
             "padded": lambda xs, cu: chunk_kda(*xs, cu_seqlens=cu, group_overhead=float("inf"))[0]}

    def work(overhead):
        def f(lens):
            C = 64
            n = [-(-x // C) for x in lens]
            return sum(len(g) * n[g[0]] * C for g in length_groups(n, overhead, power=1)) / sum(lens)
        return f

    works = {"now": work(GROUP_OVERHEAD_CHUNKS), "padded": work(float("inf"))}
    return xs, forms, works


def conv_case(cfg, T, dev):
    """The same for the short convolution."""
    D, W = cfg.kda_num_heads * cfg.kda_head_dim, 4
    xs = [torch.randn(1, T, D, device=dev, requires_grad=True), torch.randn(D, 1, W, device=dev, requires_grad=True)]

    def padded(xs, cu):
        x, w = xs
        rows, layout = pack_sequences(x, cu)  # [N, Tpad, D]
        y = F.conv1d(F.pad(rows.transpose(1, 2), (W - 1, 0)), w, groups=D).transpose(1, 2)
        return unpack_sequences(F.silu(y), layout)

    forms = {"now": lambda xs, cu: short_conv(xs[0], xs[1], cu_seqlens=cu)[0], "padded": padded}
    works = {"now": lambda lens: 1.0, "padded": lambda lens: len(lens) * max(lens) / sum(lens)}
    return xs, forms, works


CASES = {"mla": mla_case, "kda": kda_case, "conv": conv_case}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="small")
    ap.add_argument("--ops", default="mla,kda")
    ap.add_argument("--lengths", default="corpus,short")
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--batch-size", type=int, default=8, help="samples packed into one row, as k3 train does")
    ap.add_argument("--batches", type=int, default=5, help="packed rows timed (the median is reported)")
    ap.add_argument("--vocab-size", type=int, default=32768)
    ap.add_argument("--data-max-bytes", type=int, default=8_000_000)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cuda", "cpu"])
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if bad := set(args.ops.split(",")) - set(CASES):
        ap.error(f"unknown --ops {sorted(bad)}; choose from {sorted(CASES)}")
    cfg = K3Config.preset(args.preset)
    dev = torch.device(args.device)
    timer = (lambda f: cuda_time_ms(f, warmup=2, iters=5)) if dev.type == "cuda" else \
        (lambda f: cpu_time_ms(f, warmup=1, iters=2))
    rows = []
    for kind in args.lengths.split(","):
        lens = document_lengths(kind, args.vocab_size, args.data_max_bytes)
        ds = PackedDataset([[1] * n for n in lens], args.seq_len, eos_id=0, shuffle_seed=0)
        batches = [b["cu_seqlens"] for _, b in zip(range(args.batches), ds.batches(args.batch_size))]
        for op in args.ops.split(","):
            ms, works, errs = {"now": [], "padded": []}, {"now": [], "padded": []}, []
            for cu in batches:
                cu, T = cu.to(dev), int(cu[-1])
                doc_lens = [n for n in (cu[1:] - cu[:-1]).tolist() if n]
                torch.manual_seed(0)
                xs, forms, work = CASES[op](cfg, T, dev)
                outs = {}
                for form, fn in forms.items():
                    def step(fn=fn):
                        for x in xs:
                            x.grad = None
                        o = fn(xs, cu)
                        o.float().pow(2).sum().backward()
                        return o
                    outs[form] = step().detach()
                    ms[form].append(timer(step))
                    works[form].append(work[form](doc_lens))
                errs.append((outs["now"] - outs["padded"]).abs().max().item())
            row = {"op": op, "lengths": kind, "tokens_per_row": args.batch_size * args.seq_len,
                   "docs_median": statistics.median(len([n for n in (c[1:] - c[:-1]).tolist() if n]) for c in batches),
                   **{f"work_{f}": statistics.median(w) for f, w in works.items()},
                   **{f"ms_{f}": statistics.median(m) for f, m in ms.items()}, "max_err": max(errs)}
            row["speedup"] = row["ms_padded"] / row["ms_now"]
            rows.append(row)
            print(json.dumps(row), flush=True)
    print(f"\nfwd+bwd over packed documents, {args.preset} shapes, fp32, {args.batch_size} x {args.seq_len} tokens per "
          f"row, device {args.device}; median of {args.batches} rows\n")
    print("| op | lengths | documents per row | work, padded | work, now | padded | now | speed-up | max err |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['op']} | {r['lengths']} | {r['docs_median']:.0f} | {r['work_padded']:.2f}x | "
              f"{r['work_now']:.2f}x | {r['ms_padded']:.1f} ms | {r['ms_now']:.1f} ms | {r['speedup']:.2f}x | "
              f"{r['max_err']:.1e} |")
    if args.json:
        Path(args.json).write_text(json.dumps({**header(), "args": vars(args), "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
