"""k3 train: train a K3-architecture model on text (or the embedded standard-library corpus)."""

from __future__ import annotations

import dataclasses

from ..train.loop import TrainConfig, train
from .common import add_model_arguments

HELP = "train a model (resumes automatically when --out already holds a checkpoint)"


def add_train_arguments(p, defaults: TrainConfig) -> None:
    d = defaults
    p.add_argument("--data", default=d.data, help="text file, directory or JSONL ({\"text\": ...} per line); "
                   "default: the Python standard library's source, embedded in every Python install")
    p.add_argument("--out", default=d.out, required=d.out is None, help="run directory (metrics, checkpoint, plots)")
    p.add_argument("--steps", type=int, default=d.steps)
    p.add_argument("--batch-size", type=int, default=d.batch_size, help="sequences per micro-batch")
    p.add_argument("--seq-len", type=int, default=d.seq_len)
    p.add_argument("--grad-accum", type=int, default=d.grad_accum)
    p.add_argument("--lr", type=float, default=d.lr, help="peak learning rate (Muon and AdamW)")
    p.add_argument("--weight-decay", type=float, default=d.weight_decay)
    p.add_argument("--vocab-size", type=int, default=d.vocab_size, help="BPE vocabulary trained on the data")
    p.add_argument("--data-max-bytes", type=int, default=d.data_max_bytes, help="read at most this much text")
    p.add_argument("--balance", choices=["quantile", "sign", "none"], default=d.balance,
                   help="router bias balancing: Quantile Balancing (K3), DeepSeek-V3's sign rule, or off")
    p.add_argument("--mtp-weight", type=float, default=d.mtp_weight)
    p.add_argument("--qk-clip", type=float, default=d.qk_clip_tau, metavar="TAU", help="0 disables QK-clip")
    p.add_argument("--eval-every", type=int, default=d.eval_every)
    p.add_argument("--log-every", type=int, default=d.log_every)
    p.add_argument("--save-every", type=int, default=d.save_every)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--device", default=d.device, help="auto | cpu | cuda | cuda:N")
    p.add_argument("--kda-backend", choices=["auto", "torch", "fla"], default=d.kda_backend)
    p.add_argument("--memory-policy", choices=["keep", "efficient", "offload", "recompute"], default=d.memory_policy,
                   help="how activations saved for the backward are stored: keep all; efficient (AttnRes mixes and "
                   "MoE dispatch recomputed); offload (efficient + other layer activations to host memory); "
                   "recompute (whole layers)")
    p.add_argument("--compile", action="store_true", default=d.compile,
                   help="regional torch.compile: each layer's FFN, AttnRes mixes and KDA output norm (first steps "
                   "compile; CPU needs a C compiler)")
    p.add_argument("--dp", type=int, default=d.dp, help="data-parallel ranks (FSDP2); --batch-size is per rank "
                   "(per group of --cp ranks). Run under torchrun with --nproc_per_node = dp x cp x ep")
    p.add_argument("--cp", type=int, default=d.cp, help="context-parallel ranks (KCP): each sequence is split "
                   "along time; composes with --dp and --ep")
    p.add_argument("--ep", type=int, default=d.ep, help="expert-parallel ranks (MoonEP): routed experts split "
                   "over them, each rank its own slice of the batch; composes with --dp and --cp")
    p.add_argument("--stop-after", type=int, default=d.stop_after, metavar="STEP",
                   help="stop after this step with a checkpoint; run the same command again to resume")


def config_from_args(args, base: TrainConfig) -> TrainConfig:
    return dataclasses.replace(
        base, out=args.out, preset=args.preset if not args.config else None, config=args.config, data=args.data,
        steps=args.steps, batch_size=args.batch_size, seq_len=args.seq_len, grad_accum=args.grad_accum, lr=args.lr,
        weight_decay=args.weight_decay, vocab_size=args.vocab_size, data_max_bytes=args.data_max_bytes,
        balance=args.balance, mtp_weight=args.mtp_weight, qk_clip_tau=args.qk_clip or None,
        eval_every=args.eval_every, log_every=args.log_every, save_every=args.save_every, seed=args.seed,
        device=args.device, kda_backend=args.kda_backend, memory_policy=args.memory_policy, compile=args.compile,
        stop_after=args.stop_after, dp=args.dp, cp=args.cp, ep=args.ep)


def add_arguments(p) -> None:
    add_model_arguments(p, default_preset="tiny")
    add_train_arguments(p, TrainConfig(out=None))


def run_training(cfg: TrainConfig, log=print) -> tuple[dict, int]:
    """``train(cfg)`` under the plan its --dp/--ep/--cp describe (one process when all are 1) -> (result, rank)."""
    from ..distributed.plan import ParallelDims, ParallelPlan

    plan = ParallelPlan(ParallelDims(cfg.dp, cfg.ep, cfg.cp), device=cfg.device)
    try:
        return train(cfg, plan, log=log), plan.rank
    finally:
        plan.close()


def run(args) -> int:
    result, rank = run_training(config_from_args(args, TrainConfig(out=args.out)))
    if rank != 0:
        return 0
    last = result["last"]
    print(f"done: step {result['step']}, loss {last.get('loss', float('nan')):.4f}"
          + (f", val_loss {last['val_loss']:.4f}" if "val_loss" in last else "")
          + f" (unigram entropy {result['unigram_entropy']:.3f} nats); checkpoint in {result['run']}/checkpoint")
    return 0
