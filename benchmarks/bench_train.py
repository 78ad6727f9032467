"""Training throughput and MFU of a K3 model (SPEC §5 recipe: Muon + AdamW, Quantile Balancing, MTP, QK-clip),
the fla backend against the pure-torch KDA reference on the same model, in one run.

    python benchmarks/bench_train.py [--preset small] [--batch 8 --seq-len 4096] [--steps 10] [--json out.json]
    python benchmarks/bench_train.py --docs uniform,corpus --backends fla    # the packing `k3 train` feeds

``--docs``: "uniform" packs ``--batch`` documents of exactly ``--seq-len`` tokens into the step's row (one length,
the kernels' best case); "corpus" feeds what ``k3 train`` feeds: the embedded standard-library corpus through
k3's own pipeline (byte-level BPE of ``--vocab-size`` learned on its first 2 MB, documents packed into samples of
``--seq-len`` tokens, ``--batch`` samples per step, a new batch every step), so documents of every length, cut at
the sample edges. The model's vocabulary is the preset's for "uniform", the tokenizer's for "corpus".

MFU = (6 * active_params * tokens + attention FLOPs) / time / peak, peak = 780 TFLOP/s (measured bf16 on the H200).
Attention FLOPs per document of T tokens, forward + backward (3x forward):
  MLA (causal):  3 * T^2 * H * (d_qk + d_v)
  KDA (chunked): 3 * T * H * (4 * K * V + 2 * C * (K + V)), C = 64
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import header  # noqa: E402
from k3 import K3Config, K3ForCausalLM  # noqa: E402
from k3.model.params import count_parameters  # noqa: E402
from k3.train.balance import ExpertBalancer  # noqa: E402
from k3.train.optim import build_optimizer  # noqa: E402
from k3.train.qk_clip import enable_max_logit_tracking, qk_clip_  # noqa: E402

PEAK = 780e12


def flops_per_step(cfg: K3Config, tokens: int, sq_tokens: float) -> float:
    """Model FLOPs of one step of ``tokens`` tokens whose documents' squared lengths sum to ``sq_tokens``
    (causal attention is quadratic per document)."""
    dense = 6 * count_parameters(cfg)["active"] * tokens
    n_mla = len(cfg.full_attn_layers) + cfg.num_nextn_predict_layers
    mla = n_mla * 3 * sq_tokens * cfg.num_attention_heads * (cfg.qk_head_dim + cfg.v_head_dim)
    K = cfg.kda_head_dim
    kda = len(cfg.kda_layers) * 3 * tokens * cfg.kda_num_heads * (4 * K * K + 2 * 64 * 2 * K)
    return dense + mla + kda


def corpus_batches(batch: int, T: int, vocab_size: int, max_bytes: int):
    """(vocab, endless batches {"input_ids" [1, batch*T], "cu_seqlens"}) as `k3 train` builds them."""
    from k3.data import PackedDataset, encode_documents, eos_id, leading_documents, stdlib_documents, train_tokenizer

    docs = stdlib_documents(max_bytes)
    tok = train_tokenizer(leading_documents(docs, 2_000_000), vocab_size)
    data = PackedDataset(encode_documents(tok, docs), T, eos_id(tok), shuffle_seed=0)
    return tok.get_vocab_size(), data.batches(batch)


def bench(cfg: K3Config, backend: str, batch: int, T: int, steps: int, device: str, batches=None,
          profile: int = 0) -> dict:
    """One row: ``batches`` (an iterator of packed batches) or None for ``batch`` uniform documents of T tokens.
    ``profile``: after the timed steps, print the ``profile`` kernels/ops of most device time in one more step."""
    torch.manual_seed(0)
    model = K3ForCausalLM(cfg).to(device)
    model.set_kda_backend(backend)
    opt = build_optimizer(model, lr=1e-3)
    bal = ExpertBalancer(model)
    enable_max_logit_tracking(model)
    ids = torch.randint(0, cfg.vocab_size, (1, batch * T), device=device)
    cu = torch.arange(0, batch * T + 1, T, device=device)  # `batch` documents of T tokens, packed
    amp = torch.autocast("cuda", dtype=torch.bfloat16) if device == "cuda" else torch.autocast("cpu", enabled=False)
    docs, sq, load = [], [], []  # documents (pieces) per step, their squared lengths' sum, MoE max/mean load

    def step():
        nonlocal ids, cu
        if batches is not None:
            b = next(batches)
            ids, cu = b["input_ids"].to(device), b["cu_seqlens"].to(device)
        docs.append(len(cu) - 1)
        sq.append(float(cu.diff().double().pow(2).sum()))
        with amp:
            out = model(ids, cu_seqlens=cu, labels=ids, return_logits=False)
        out["loss"].backward()
        bal.observe()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        qk_clip_(model, 100.0)
        load.append(bal.step()["load_max_over_mean"])  # the worst layer's routed-token max/mean
        return out["loss"]

    for _ in range(3):  # warm-up: fla's autotuning, allocator
        step()
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    t0, each = time.perf_counter(), []
    for _ in range(steps):  # one device wait per step (as `k3 train`, which reads the loss): per-step times
        t1 = time.perf_counter()
        loss = float(step().detach())
        each.append((time.perf_counter() - t1) * 1e3)
    dt = (time.perf_counter() - t0) / steps
    tokens = batch * T
    if profile:
        from torch.profiler import ProfilerActivity, profile as torch_profile

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
        with torch_profile(activities=acts) as prof:
            float(step().detach())
        key = "self_cuda_time_total" if device == "cuda" else "self_cpu_time_total"
        print(f"# profile: {backend}, {'uniform' if batches is None else 'corpus'} documents, one step",
              flush=True)
        print(prof.key_averages().table(sort_by=key, row_limit=profile, max_name_column_width=70), flush=True)
    return {"backend": backend, "docs": "uniform" if batches is None else "corpus",
            "docs_per_step": sum(docs[3:3 + steps]) / steps, "step_s": dt, "tokens_per_s": tokens / dt,
            "mfu": flops_per_step(cfg, tokens, sum(sq[3:3 + steps]) / steps) / dt / PEAK, "loss": loss,
            "each_step_ms": [round(x, 1) for x in each],
            "load_max_over_mean": [round(x, 2) for x in load[3:3 + steps]],
            "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else None}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="small")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--backends", default="fla,torch")
    ap.add_argument("--docs", default="uniform", help="comma-separated, of uniform, corpus (see above)")
    ap.add_argument("--vocab-size", type=int, default=32768, help="--docs corpus: the BPE's size (k3 train's default)")
    ap.add_argument("--data-max-bytes", type=int, default=8_000_000, help="--docs corpus: bytes of the corpus")
    ap.add_argument("--profile", type=int, default=0, metavar="N",
                    help="print the N ops/kernels of most device time in one extra step per row (torch.profiler)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    cfg = K3Config.preset(args.preset)
    kinds = args.docs.split(",")
    if set(kinds) - {"uniform", "corpus"}:
        ap.error(f"--docs: unknown {sorted(set(kinds) - {'uniform', 'corpus'})}; choose from uniform, corpus")
    rows = []
    for kind in kinds:
        for b in args.backends.split(","):
            if kind == "corpus":
                vocab, batches = corpus_batches(args.batch, args.seq_len, args.vocab_size, args.data_max_bytes)
                row = bench(cfg.replace(vocab_size=vocab), b, args.batch, args.seq_len, args.steps, args.device,
                            batches, args.profile)
            else:
                row = bench(cfg, b, args.batch, args.seq_len, args.steps, args.device, profile=args.profile)
            rows.append(row)
            print(json.dumps(rows[-1]), flush=True)
    out = {**header(), "preset": args.preset, "batch": args.batch, "seq_len": args.seq_len,
           "active_params": count_parameters(cfg)["active"], "rows": rows}
    print(f"\n{args.preset}: {args.batch} x {args.seq_len} tokens per step, active params {out['active_params'] / 1e6:.1f}M")
    print("| documents | KDA backend | docs/step | step | tokens/s | MFU | peak memory |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        mem = f"{r['peak_mem_gib']:.1f} GiB" if r["peak_mem_gib"] is not None else "-"
        print(f"| {r['docs']} | {r['backend']} | {r['docs_per_step']:.1f} | {r['step_s'] * 1e3:.0f} ms | "
              f"{r['tokens_per_s']:,.0f} | {r['mfu']:.1%} | {mem} |")
    for kind in kinds:
        by = {r["backend"]: r for r in rows if r["docs"] == kind}
        if "fla" in by and "torch" in by:
            print(f"{kind}: fla / torch tokens/s: {by['fla']['tokens_per_s'] / by['torch']['tokens_per_s']:.2f}x")
    if {"uniform", "corpus"} <= set(kinds):
        for b in args.backends.split(","):
            u, c = (next(r for r in rows if r["docs"] == k and r["backend"] == b) for k in ("uniform", "corpus"))
            print(f"{b}: corpus / uniform tokens/s: {c['tokens_per_s'] / u['tokens_per_s']:.2f}x")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
