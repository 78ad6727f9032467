"""k3 train: train a K3-architecture model on text (or the embedded standard-library corpus)."""

from __future__ import annotations

import dataclasses
import sys

from ..train.loop import MIN_SEQ_LEN, TrainConfig, train
from .common import (add_device_argument, add_model_arguments, add_threads_argument, add_verify_argument, apply_threads,
                     int_at_least, number, positive_int, seed)

HELP = "train a model (resumes automatically when --out already holds a checkpoint)"


def add_train_arguments(p, defaults: TrainConfig) -> None:
    d = defaults
    p.add_argument("--data", default=d.data, help="text file, directory or JSONL ({\"text\": ...} per line); "
                   "default: the Python standard library's source, embedded in every Python install")
    p.add_argument("--out", default=d.out, required=d.out is None, help="run directory (metrics, checkpoint, plots)")
    p.add_argument("--steps", type=positive_int, default=d.steps,
                   help="optimiser steps in all; a larger value extends a finished run")
    p.add_argument("--batch-size", type=positive_int, default=d.batch_size, help="sequences per micro-batch")
    p.add_argument("--seq-len", type=int_at_least(MIN_SEQ_LEN), default=d.seq_len, help="tokens per sequence")
    p.add_argument("--grad-accum", type=positive_int, default=d.grad_accum, help="micro-batches per optimiser step")
    p.add_argument("--lr", type=number(0, lo_open=True), default=d.lr, help="peak learning rate (Muon and AdamW)")
    p.add_argument("--weight-decay", type=number(0), default=d.weight_decay, help="decoupled weight decay")
    p.add_argument("--vocab-size", type=int_at_least(257, " (256 byte tokens + <|endoftext|>)"), default=d.vocab_size,
                   help="BPE vocabulary trained on the data")
    p.add_argument("--data-max-bytes", type=positive_int, default=d.data_max_bytes, help="read at most this much text")
    p.add_argument("--doc-chars", type=positive_int, default=d.doc_chars,
                   help="cut --data text at blank lines into documents of at most this many characters "
                   "(default: max(8192, 8 x --seq-len)); raise it for long-context training")
    p.add_argument("--balance", choices=["quantile", "sign", "none"], default=d.balance,
                   help="router bias balancing: Quantile Balancing (K3), DeepSeek-V3's sign rule, or off")
    p.add_argument("--mtp-weight", type=number(0), default=d.mtp_weight, help="weight of the MTP loss (0 = off)")
    p.add_argument("--qk-clip", type=number(0), default=d.qk_clip_tau, metavar="TAU", help="0 disables QK-clip")
    p.add_argument("--eval-every", type=positive_int, default=d.eval_every, help="validation loss every N steps")
    p.add_argument("--log-every", type=positive_int, default=d.log_every, help="a metrics line every N steps")
    p.add_argument("--save-every", type=positive_int, default=d.save_every,
                   help="a checkpoint every N steps (default: every 10%% of --steps)")
    p.add_argument("--save-minutes", type=number(0), default=d.save_minutes, metavar="MINUTES",
                   help="also a checkpoint once this many minutes have passed since the last one, whichever comes "
                   "first (0 = only by steps): a killed run loses at most this much")
    p.add_argument("--seed", type=seed, default=d.seed, help="model init, data order and split")
    add_device_argument(p, d.device)
    p.add_argument("--kda-backend", choices=["auto", "torch", "fla"], default=d.kda_backend,
                   help="KDA kernels: fla-core's on CUDA (auto) or the pure-torch reference")
    p.add_argument("--memory-policy", choices=["keep", "efficient", "offload", "recompute"], default=d.memory_policy,
                   help="how activations saved for the backward are stored: keep all; efficient (AttnRes mixes and "
                   "MoE dispatch recomputed); offload (efficient + other layer activations to host memory); "
                   "recompute (whole layers)")
    p.add_argument("--compile", action="store_true", default=d.compile,
                   help="regional torch.compile: each layer's FFN, AttnRes mixes and KDA output norm (first steps "
                   "compile; CPU needs a C compiler)")
    p.add_argument("--cuda-graph", action="store_true", default=d.cuda_graph,
                   help="capture the micro-batch's forward + backward as one CUDA graph and replay it every step (one "
                   "process, CUDA; any document boundaries)")
    p.add_argument("--packing", choices=["documents", "stream"], default=d.packing,
                   help="documents: each document its own segment (attention and KDA state reset at its start); "
                   "stream: samples of the EOS-separated stream as one segment each (GPT-style)")
    p.add_argument("--dp", type=positive_int, default=d.dp, help="data-parallel ranks (FSDP2); --batch-size is "
                   "per rank (per group of --cp ranks). Run under torchrun with --nproc_per_node = dp x cp x ep")
    p.add_argument("--cp", type=positive_int, default=d.cp, help="context-parallel ranks (KCP): each sequence is "
                   "split along time; composes with --dp and --ep")
    p.add_argument("--ep", type=positive_int, default=d.ep, help="expert-parallel ranks (MoonEP): routed experts "
                   "split over them, each rank its own slice of the batch; composes with --dp and --cp")
    p.add_argument("--pp", type=positive_int, default=d.pp, help="pipeline ranks: decoder layers cut into stages "
                   "(torch.distributed.pipelining; --grad-accum micro-batches); composes with --dp and --ep. Run under "
                   "torchrun with --nproc_per_node = pp x dp x ep x cp")
    p.add_argument("--pp-schedule", choices=["1f1b", "interleaved", "zero-bubble"], default=d.pp_schedule,
                   help="1f1b (one stage per rank), interleaved (--pp-virtual stages per rank, looped) or zero-bubble "
                   "(ZBV: 2 stages per rank in a V, weight gradients deferred into the bubble)")
    p.add_argument("--pp-virtual", type=positive_int, default=d.pp_virtual, metavar="V",
                   help="stages per pipeline rank (default 1 for 1f1b, 2 for interleaved and zero-bubble)")
    p.add_argument("--pp-layers", type=_layer_counts, default=d.pp_layers, metavar="N,N,...",
                   help="decoder layers per stage (pp x V counts summing to the model's layers); default: balanced "
                   "by the cost model (k3.distributed.pipeline.split_layers)")
    p.add_argument("--qat", choices=["mxfp4"], default=d.qat, help="quantisation-aware training: routed experts "
                   "with MXFP4 weights and MXFP8 inputs (fake-quant), recorded in the checkpoint's config.json")
    p.add_argument("--init-from", default=d.init_from, metavar="CHECKPOINT", help="start from this checkpoint's "
                   "weights and tokenizer (fine-tuning; e.g. with --qat)")
    p.add_argument("--stop-after", type=positive_int, default=d.stop_after, metavar="STEP",
                   help="stop after this step with a checkpoint; run the same command again to resume")
    add_verify_argument(p)


def _layer_counts(text: str) -> tuple[int, ...]:
    import argparse

    try:
        counts = tuple(int(x) for x in text.split(","))
    except ValueError:
        counts = ()
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: give positive layer counts separated by commas, e.g. 2,2,1,1")
    return counts


def config_from_args(args, base: TrainConfig) -> TrainConfig:
    return dataclasses.replace(
        base, out=args.out, preset=args.preset if not args.config else None, config=args.config, data=args.data,
        steps=args.steps, batch_size=args.batch_size, seq_len=args.seq_len, grad_accum=args.grad_accum, lr=args.lr,
        weight_decay=args.weight_decay, vocab_size=args.vocab_size, data_max_bytes=args.data_max_bytes,
        doc_chars=args.doc_chars, balance=args.balance, mtp_weight=args.mtp_weight, qk_clip_tau=args.qk_clip or None,
        eval_every=args.eval_every, log_every=args.log_every, save_every=args.save_every, seed=args.seed,
        device=args.device, kda_backend=args.kda_backend, memory_policy=args.memory_policy, compile=args.compile,
        cuda_graph=args.cuda_graph, packing=args.packing, save_minutes=args.save_minutes,
        stop_after=args.stop_after, dp=args.dp, cp=args.cp, ep=args.ep, pp=args.pp,
        pp_schedule=args.pp_schedule, pp_virtual=args.pp_virtual, pp_layers=args.pp_layers, verify=args.verify, qat=args.qat,
        init_from=args.init_from, chat=base.chat)


def add_arguments(p) -> None:
    add_model_arguments(p, default_preset="tiny")
    add_train_arguments(p, TrainConfig(out=None))
    add_threads_argument(p, None)


def interrupted_message(out: str, e: KeyboardInterrupt) -> str:
    """Where a run stopped by Ctrl-C can be resumed from (the checkpoint it saved, or the last one)."""
    from ..train.state import find_checkpoint, read_step

    ckpt = getattr(e, "checkpoint", None) or find_checkpoint(out)
    if ckpt is None:
        return f"interrupted before the first checkpoint (see --save-every, --save-minutes); nothing saved in {out}"
    step = getattr(e, "step", None) or read_step(ckpt)
    return f"interrupted; the checkpoint of step {step} is in {ckpt}: run the same command again to resume from it"


def run_training(cfg: TrainConfig, log=print, command: str = "train", prepare=None) -> tuple[dict | None, int]:
    """``train(cfg)`` under the plan its --dp/--ep/--cp describe (one process when all are 1) -> (result, rank);
    result is None when Ctrl-C stopped the run (rank 0 has said where its checkpoint is). ``prepare``: the data
    step (``k3.train.loop.train``'s)."""
    from ..distributed.plan import ParallelDims, ParallelPlan
    from ..train.loop import resolve_device

    dims = ParallelDims(cfg.dp, cfg.ep, cfg.cp)
    if cfg.pp > 1:
        from ..distributed.pipeline_plan import PipelineDims, PipelinePlan

        pipe = PipelineDims(cfg.pp, cfg.pp_schedule, cfg.pp_virtual, cfg.pp_layers)
        plan = PipelinePlan(dims, pipe, resolve_device(cfg.device), cfg.grad_accum, cfg.seq_len, cfg.batch_size)
    else:
        plan = ParallelPlan(dims, device=resolve_device(cfg.device))
    try:
        return train(cfg, plan, log=log, prepare=prepare), plan.rank
    except KeyboardInterrupt as e:
        if plan.rank == 0:
            print(f"k3 {command}: {interrupted_message(cfg.out, e)}", file=sys.stderr)
        return None, plan.rank
    finally:
        plan.close()


def report(result: dict | None, rank: int, note) -> int:
    """The exit status of a training command, and its last line on rank 0: ``note(result)`` after the losses."""
    if result is None:
        return 130
    if rank != 0 or result.get("already_complete"):
        return 0
    last = result["last"]
    print(f"done: step {result['step']}, loss {last['loss']:.4f}"
          + (f", val_loss {last['val_loss']:.4f}" if "val_loss" in last else "")
          + f" ({note(result)}); checkpoint in {result['run']}/checkpoint")
    return 0


def run(args) -> int:
    apply_threads(args)
    return report(*run_training(config_from_args(args, TrainConfig(out=args.out))),
                  lambda r: f"unigram entropy {r['unigram_entropy']:.3f} nats")
