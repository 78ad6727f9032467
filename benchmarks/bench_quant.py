"""MXFP4 routed experts with MXFP8 activations (SPEC §6): quality of QAT against post-training quantisation, the
memory of packed experts, and (on CUDA) the packed grouped matmul and decode against bf16.

  quality  (CPU or GPU) the embedded corpus, `k3 train` runs: a base model trained ``--base-steps`` unquantised,
           then two fine-tunes of ``--ft-steps`` from it with the same data and schedule: "control" unquantised,
           "qat" with ``--qat mxfp4``. Validation loss (the same ``--eval-batches`` batches for every row) of:
           control unquantised (the reference); control quantised after training (PTQ), served packed; qat
           exported (``save_pretrained(quantization="mxfp4")``) and served packed (``load_pretrained(...,
           keep_packed=True)``); qat's fake-quant training forward (must equal the packed number). Served packed =
           MXFP4 weights and MXFP8 expert inputs, exactly what `k3 serve --packed-experts` computes.
  memory   routed-expert bytes packed (uint8 nibbles + E8M0 scales) vs bf16, and the whole model, for presets on
           the meta device (no memory used), plus the bytes of the tiny model loaded packed.
  gpu      (CUDA only; the lead's run) time per call of the packed grouped matmul (Triton, dequantising per tile)
           against torch's bf16 grouped matmul (``torch._grouped_mm``) on the same routed rows, for the `small`
           experts and K3's experts (112 of them: one GPU's share of 896 over 8), decode to prefill row counts; the
           whole expert block (packed bank vs bf16 bank); and decode tokens/s of the `small` model (random
           weights, bf16; ``--decode-presets small,medium`` adds others) through the engine, bf16 experts vs packed.

    python benchmarks/bench_quant.py                       # quality + memory on CPU (500 training steps)
    python benchmarks/bench_quant.py --sections gpu        # on a CUDA machine with triton
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import cuda_time_ms, header, rel_rms  # noqa: E402
from k3 import K3Config, K3ForCausalLM  # noqa: E402
from k3.pretrained import load_pretrained, save_pretrained  # noqa: E402
from k3.data import encode_documents, eos_id, load_tokenizer, split_documents, stdlib_documents  # noqa: E402
from k3.data.packing import PackedDataset  # noqa: E402
from k3.distributed.plan import ParallelDims, ParallelPlan  # noqa: E402
from k3.model.params import count_bytes, memory_summary  # noqa: E402
from k3.quant import pack_experts  # noqa: E402
from k3.train.loop import TrainConfig, evaluate, train  # noqa: E402


# ---------------------------------------------------------------- quality


def quality(args, dev) -> dict:
    run = Path(args.run)
    run.mkdir(parents=True, exist_ok=True)
    cfg = K3Config.preset(args.preset)
    if args.moe_intermediate_size or args.expert_width or args.num_shared_experts is not None:
        cfg = cfg.replace(moe_intermediate_size=args.moe_intermediate_size or cfg.moe_intermediate_size,
                          routed_expert_hidden_size=args.expert_width or cfg.routed_expert_hidden_size,
                          num_shared_experts=cfg.num_shared_experts if args.num_shared_experts is None
                          else args.num_shared_experts)
    cfg.save(run / "config.json")
    base = TrainConfig(out=str(run / "base"), preset=None, config=str(run / "config.json"),
                       data_max_bytes=args.data_max_bytes,
                       tokenizer_bytes=3_000_000, vocab_size=args.vocab_size, steps=args.base_steps,
                       batch_size=args.batch_size, seq_len=args.seq_len, lr=args.lr, eval_every=args.base_steps,
                       eval_batches=4, log_every=50, save_every=args.base_steps, device=str(dev))
    t0 = time.time()
    ft = dict(init_from=str(run / "base" / "checkpoint"), steps=args.ft_steps, lr=args.ft_lr, eval_every=args.ft_steps,
              save_every=args.ft_steps)
    for cfg_ in (base, dataclasses.replace(base, out=str(run / "control"), **ft),
                 dataclasses.replace(base, out=str(run / "qat"), qat="mxfp4", **ft)):
        if not (args.eval_only and (Path(cfg_.out) / "checkpoint").is_dir()):
            train(cfg_, ParallelPlan(ParallelDims(), dev), log=print)
    train_s = time.time() - t0

    tok = load_tokenizer(run / "base" / "checkpoint" / "tokenizer.json")
    _, val_docs = split_documents(stdlib_documents(args.data_max_bytes), base.val_fraction, base.seed)
    val = PackedDataset(encode_documents(tok, val_docs), args.seq_len, eos_id(tok), shuffle_seed=None)
    batches = [_OneBatch(b) for b, _ in zip(val.eval_batches(args.batch_size), range(args.eval_batches))]
    tokens = len(batches) * args.batch_size * args.seq_len

    def val_loss(model):
        """(mean loss, per-batch losses): the same batches pair the rows for the standard errors."""
        per = [evaluate(model.to(dev), one, args.batch_size, 1, dev, nullcontext()) for one in batches]
        return sum(per) / len(per), per

    def ckpt(name):
        return run / name / "checkpoint"

    save_pretrained(load_pretrained(ckpt("qat"), dtype=torch.float32), run / "qat_mxfp4", quantization="mxfp4")
    qat_off = K3Config.from_hf(ckpt("qat")).replace(qat=None)
    rows = {
        "base, unquantised": val_loss(load_pretrained(ckpt("base"), dtype=torch.float32)),
        "base, PTQ served packed": val_loss(load_pretrained(ckpt("base"), dtype=torch.float32, keep_packed=True)),
        "control, unquantised": val_loss(load_pretrained(ckpt("control"), dtype=torch.float32)),
        "control, PTQ served packed": val_loss(load_pretrained(ckpt("control"), dtype=torch.float32,
                                                               keep_packed=True)),
        "qat, fake-quant training forward": val_loss(load_pretrained(ckpt("qat"), dtype=torch.float32)),
        "qat, exported and served packed": val_loss(load_pretrained(run / "qat_mxfp4", dtype=torch.float32,
                                                                    keep_packed=True)),
        "qat, master weights unquantised": val_loss(load_pretrained(ckpt("qat"), config=qat_off, dtype=torch.float32)),
    }
    per = {k: v[1] for k, v in rows.items()}
    rows = {k: v[0] for k, v in rows.items()}

    def paired(k):  # the relative loss against the control and its standard error over the paired batches
        d = torch.tensor(per[k]) / torch.tensor(per["control, unquantised"]) - 1
        return d.mean().item(), (d.std() / len(d) ** 0.5).item()

    expert_params = sum(p.numel() for n, p in load_pretrained(ckpt("base")).named_parameters() if ".experts." in n)
    model = {"moe_intermediate_size": cfg.moe_intermediate_size, "expert_width": cfg.expert_dim,
             "num_shared_experts": cfg.num_shared_experts, "routed_expert_params": expert_params}
    out = {"preset": args.preset, "model": model,
           "base_steps": args.base_steps, "ft_steps": args.ft_steps, "batch": f"{args.batch_size}x{args.seq_len}",
           "lr": args.lr, "ft_lr": args.ft_lr, "val_tokens": tokens, "train_s": round(train_s), "val_loss": rows,
           "vs_control_paired": {k: paired(k) for k in rows}}
    print("\n| model | validation loss | vs control unquantised (+- standard error over the batches) |\n|---|---|---|")
    for k, v in rows.items():
        m, se = out["vs_control_paired"][k]
        print(f"| {k} | {v:.4f} | {m:+.3%} +- {se:.3%} |")
    return out


class _OneBatch:
    """One fixed validation batch, as ``evaluate`` reads a dataset (``eval_batches``)."""

    def __init__(self, batch):
        self.batch = batch

    def eval_batches(self, batch_size):
        yield self.batch


# ---------------------------------------------------------------- memory


def memory(args) -> dict:
    from k3.cli.params import weight_bytes

    out = {}
    for preset in ("tiny", "small", "kimi-k3"):
        b = weight_bytes(K3Config.preset(preset))
        out[preset] = {"experts_bf16": b["bf16"]["routed_experts"], "experts_packed": b["packed"]["routed_experts"],
                       "model_bf16": sum(b["bf16"].values()), "model_packed": sum(b["packed"].values())}
        r = out[preset]
        print(f"{preset}: routed experts {r['experts_bf16'] / 2**30:.4g} GiB bf16 -> {r['experts_packed'] / 2**30:.4g}"
              f" GiB packed ({r['experts_packed'] / r['experts_bf16']:.4f}x); model {r['model_bf16'] / 2**30:.4g} -> "
              f"{r['model_packed'] / 2**30:.4g} GiB ({r['model_packed'] / r['model_bf16']:.3f}x)")
    model = pack_experts(K3ForCausalLM(K3Config.preset("tiny")))
    out["tiny_loaded_packed"] = {"summary": memory_summary(model), "bytes": count_bytes(model)}
    print("tiny, fp32 with packed experts:", out["tiny_loaded_packed"]["summary"])
    return out


# ---------------------------------------------------------------- GPU


def _routed_rows(tokens, E, k, gen, device):
    idx = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(tokens)]).reshape(-1)
    return torch.bincount(idx, minlength=E).to(device)


def gpu(args) -> dict:
    from k3.layers.width.latent_moe import ExpertBank
    from k3.ops.grouped_mm import grouped_mm
    from k3.quant.packed import PackedExpertBank, packed_grouped_mm

    dev = torch.device("cuda")
    gen = torch.Generator().manual_seed(0)
    rows = []
    k3 = K3Config.preset("kimi-k3")
    for name, cfg in (("small", K3Config.preset("small")), ("kimi-k3, 112 experts", k3.replace(num_experts=112))):
        torch.manual_seed(0)
        bank = ExpertBank(cfg).to(dev)
        ref = ExpertBank(cfg).to(dev, torch.bfloat16)
        ref.load_state_dict(bank.state_dict())
        packed = PackedExpertBank.from_bank(bank, cfg)
        E, L, k = cfg.num_experts, cfg.expert_dim, cfg.num_experts_per_token
        for tokens in (8, 64, 512, 4096):
            counts = _routed_rows(tokens, E, k, gen, dev)
            x = torch.randn(int(counts.sum()), L, device=dev, dtype=torch.bfloat16)
            w1 = ref.w1.detach()
            t_bf16 = cuda_time_ms(lambda: grouped_mm(x, w1, counts), iters=20)
            t_packed = cuda_time_ms(lambda: packed_grouped_mm(x, packed.w1, counts), iters=20)
            err = rel_rms(grouped_mm(x, packed_weights(packed.w1), counts), packed_grouped_mm(x, packed.w1, counts))
            with torch.no_grad():
                b_bf16 = cuda_time_ms(lambda: ref.compute(x, counts), iters=20)
                b_packed = cuda_time_ms(lambda: packed.compute(x, counts), iters=20)
            rows.append({"experts": name, "tokens": tokens, "rows": int(counts.sum()), "w1_bf16_ms": t_bf16,
                         "w1_packed_ms": t_packed, "w1_packed_rel_rms_vs_bf16_of_same_weights": err,
                         "bank_bf16_ms": b_bf16, "bank_packed_ms": b_packed})
            print(json.dumps(rows[-1]), flush=True)
        del bank, ref, packed
        torch.cuda.empty_cache()
    return {"grouped_mm": rows, "decode": decode(args, dev)}


def packed_weights(w):
    """The bf16 weights a PackedWeight decodes to (for the accuracy column)."""
    from k3.ops.mx import dequantize_mxfp4

    return dequantize_mxfp4(w.weight_packed, w.weight_scale, torch.bfloat16)


def decode(args, dev) -> list[dict]:
    from k3.data.tokenizer import train_tokenizer
    from k3.inference.api import SamplingParams
    from k3.inference.engine import Engine, EngineConfig

    tok = train_tokenizer(["k3 benchmark text " * 50], 300)
    out = []
    for preset, packed in [(p, k) for p in args.decode_presets.split(",") for k in (False, True)]:
        torch.manual_seed(0)
        model = K3ForCausalLM(K3Config.preset(preset).replace(vocab_size=tok.get_vocab_size(),
                                                              num_nextn_predict_layers=0)).to(dev, torch.bfloat16)
        if packed:
            pack_experts(model)
        # graphs only up to the batch measured (capturing every bucket to 256 twice outlasted a 150 s step)
        engine = Engine(model, tok, EngineConfig(num_pages=256, page_tokens=1024, hash_block=512,
                                                 max_batch=args.decode_batch, compile=not args.no_decode_compile))
        prompts = [[5 + i, 6, 7, 8] * 16 for i in range(args.decode_batch)]
        params = SamplingParams(max_tokens=args.decode_tokens, temperature=0)
        engine.generate(prompts, SamplingParams(max_tokens=4, temperature=0))  # warm-up (Triton compiles)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        engine.generate(prompts, params)
        torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        out.append({"preset": preset, "experts": "packed MXFP4" if packed else "bf16", "batch": args.decode_batch,
                    "compiled": not args.no_decode_compile,
                    "tokens_per_s": args.decode_batch * args.decode_tokens / dt, "memory": memory_summary(model)})
        print(json.dumps(out[-1]), flush=True)
        del engine, model
        torch.cuda.empty_cache()
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sections", default="quality,memory", help="comma list of quality, memory, gpu (the grouped "
                    "matmul and decode), decode (decode alone)")
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--run", default="runs/bench_quant", help="where the quality section's runs go")
    ap.add_argument("--moe-intermediate-size", type=int, default=None, help="override the preset's expert width")
    ap.add_argument("--expert-width", type=int, default=None, help="override the latent width the experts read")
    ap.add_argument("--num-shared-experts", type=int, default=None, help="override (0: the routed experts carry "
                    "the whole FFN, so their quantisation matters more)")
    ap.add_argument("--base-steps", type=int, default=300)
    ap.add_argument("--ft-steps", type=int, default=100)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--ft-lr", type=float, default=1e-3)
    ap.add_argument("--vocab-size", type=int, default=2048)
    ap.add_argument("--data-max-bytes", type=int, default=6_000_000)
    ap.add_argument("--eval-batches", type=int, default=64)
    ap.add_argument("--eval-only", action="store_true", help="reuse the runs already in --run (no training)")
    ap.add_argument("--decode-batch", type=int, default=8)
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--decode-presets", default="small", help="comma list of the presets whose decode is measured, "
                    "each bf16 then packed (e.g. small,medium)")
    ap.add_argument("--no-decode-compile", action="store_true", help="decode graphs of the eager forward (no "
                    "torch.compile: minutes less per engine for a large preset; bf16 and packed alike)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    sections = args.sections.split(",")
    out = {**header()}
    if "memory" in sections:
        out["memory"] = memory(args)
    if "quality" in sections:
        out["quality"] = quality(args, torch.device(args.device))
    if "gpu" in sections:
        if not torch.cuda.is_available():
            raise SystemExit("the gpu section needs CUDA (and triton)")
        out["gpu"] = gpu(args)
    elif "decode" in sections:
        if not torch.cuda.is_available():
            raise SystemExit("the decode section needs CUDA (and triton)")
        out["gpu"] = {"decode": decode(args, torch.device("cuda"))}
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
