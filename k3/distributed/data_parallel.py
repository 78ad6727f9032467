"""Sharded data parallelism with FSDP2 (``fully_shard``) over a DeviceMesh (SPEC §8), applied from outside.

``init_from_env(device)`` joins the process group torchrun describes (gloo on CPU, NCCL on CUDA); ``apply_fsdp``
shards every decoder layer (and MTP layer) and then the root, so parameters, gradients and optimiser state
are sharded along dim 0 across the data-parallel ranks. Collective helpers used by the training loop live
here too: the loss average, the MAX of MLA max-logits (QK-clip must see the global maximum), and full
(unsharded) state dicts for checkpoints.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist


def init_from_env(device: str | torch.device | None = None) -> tuple[int, int, torch.device]:
    """(rank, world_size, device). Without torchrun's environment: (0, 1, the device) and no process group.

    ``device``: the TrainConfig's device ("auto", "cpu", "cuda", "cuda:N"); None means "auto" (CUDA when
    available). Under torchrun a CUDA device means NCCL and cuda:LOCAL_RANK for every rank (so "cuda:N" is
    refused there), anything else gloo and that device: ``--device cpu`` on a GPU machine runs on gloo."""
    want = torch.device("cuda" if torch.cuda.is_available() else "cpu") if device in (None, "auto") \
        else torch.device(device)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return 0, 1, want
    cuda = want.type == "cuda"
    if cuda and want.index is not None:
        raise ValueError(f"device {str(want)!r} names one GPU, but under torchrun rank r uses cuda:LOCAL_RANK; "
                         f"pass --device cuda (or auto)")
    if cuda and not torch.cuda.is_available():
        raise RuntimeError("device 'cuda' was asked for, but CUDA is not available; pass --device cpu")
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if cuda:  # before the process group, so that NCCL binds this rank's GPU
        torch.cuda.set_device(local)
    if not dist.is_initialized():
        if cuda:
            dist.init_process_group("nccl", device_id=torch.device("cuda", local))
        else:
            dist.init_process_group("gloo")
    rank = dist.get_rank()
    if cuda:
        return rank, world, torch.device("cuda", torch.cuda.current_device())
    return rank, world, want


def collective_device(group=None) -> torch.device:
    """Where a small host-built tensor (a loss, a count, a range) must live for a collective over ``group``:
    the current CUDA device under NCCL, which has no CPU transport; the CPU otherwise."""
    if dist.get_backend(group) == dist.Backend.NCCL:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def apply_fsdp(model: torch.nn.Module, world: int, device: torch.device):
    """fully_shard each DecoderLayer / MTP layer, then the whole model, on a 1-D mesh of ``world`` ranks."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("dp",))
    for layer in list(model.model.layers) + list(model.mtp):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return mesh


def mean_across_ranks(x: float) -> float:
    if not is_distributed():
        return x
    t = torch.tensor([x], dtype=torch.float64, device=collective_device())
    dist.all_reduce(t)
    return float(t) / dist.get_world_size()


def max_logits_across_ranks(model: torch.nn.Module) -> None:
    """QK-clip must compare the GLOBAL max logit of each head with tau: all-reduce (MAX) what each rank saw."""
    if not is_distributed():
        return
    from ..layers.sequence.mla import GatedMLA

    for m in model.modules():
        if isinstance(m, GatedMLA) and getattr(m, "max_logit", None) is not None:
            dist.all_reduce(m.max_logit, op=dist.ReduceOp.MAX)


def full_model_state(model: torch.nn.Module) -> dict:
    """Unsharded tensors (on CPU) of every parameter and buffer: collective, every rank must call it."""
    if not is_distributed():
        return model.state_dict()
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


class ParallelContext:
    """What ``k3.train.loop.train`` needs from a multi-process run (the loop never imports this package: the
    CLI builds one and passes it in). Subclasses say how the model is split (``shard``), how a rank's loss is
    formed (``loss``) and how gradients are combined (``reduce_grads``)."""

    def __init__(self, rank: int, world: int, device: torch.device):
        self.rank, self.world, self.device = rank, world, device

    @classmethod
    def from_env(cls, device: str | torch.device | None = None):
        """Join torchrun's process group; ``device``: the TrainConfig's device (see ``init_from_env``)."""
        return cls(*init_from_env(device))

    @staticmethod
    def launched() -> bool:
        """True under torchrun (or any launcher that sets WORLD_SIZE > 1)."""
        return int(os.environ.get("WORLD_SIZE", "1")) > 1

    def mean(self, x: float) -> float:
        return mean_across_ranks(x)

    def sync_max_logits(self, model: torch.nn.Module) -> None:
        max_logits_across_ranks(model)

    def full_state(self, model: torch.nn.Module) -> dict:
        return full_model_state(model)

    def reduce_grads(self, model: torch.nn.Module) -> None:
        pass

    def barrier(self) -> None:
        if self.world > 1:
            dist.barrier()

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


class DataParallel(ParallelContext):
    """``k3 train --dp N``: FSDP2 over all ranks, each training on its slice of the global batch."""

    def shard(self, model: torch.nn.Module) -> None:
        if self.world > 1:
            apply_fsdp(model, self.world, self.device)

    def loss(self, model, batch: dict, mtp_weight: float, device):
        """This rank's slice of the global batch. FSDP averages gradients over ranks; weighting each rank's mean
        by its share of the global batch's predicted tokens makes that average the global token mean, exactly
        as in one process. Returns (loss to backpropagate, lm loss, mtp loss or None, global tokens)."""
        return weighted_slice_loss(model, batch, mtp_weight, device, self.rank, self.world, self.mean)


def rank_slice(batch: dict, rank: int, world: int):
    """This rank's part of a packed global batch of ``world`` equal slices: (input_ids [1,n], cu_seqlens,
    shares), shares[d] = this rank's positions that predict the token d ahead (d = 1: next token, d = 2: the
    first MTP layer's) * world / the global batch's. Sample boundaries are document boundaries, so a slice is a
    whole number of samples."""
    ids, cu = batch["input_ids"], batch["cu_seqlens"]
    n = ids.shape[1] // world
    lo, hi = rank * n, (rank + 1) * n
    local = cu[(cu >= lo) & (cu <= hi)] - lo

    def predicted(c, d):  # positions of a document that have a target d tokens ahead inside it
        return int((c[1:] - c[:-1] - d).clamp(min=0).sum())

    shares = {d: predicted(local, d) * world / max(predicted(cu, d), 1) for d in (1, 2)}
    return ids[:, lo:hi], local, shares


def weighted_slice_loss(model, batch, mtp_weight, device, rank, world, mean):
    """The loss of this rank's slice, each term weighted by its share of the global predictions."""
    ids, cu, shares = rank_slice(batch, rank, world)
    ids, cu = ids.to(device), cu.to(device)
    out = model(ids, cu_seqlens=cu, labels=ids, mtp_weight=mtp_weight, return_logits=False)
    loss = out["lm_loss"] * shares[1]
    mtp = None
    if "mtp_loss" in out:
        loss = loss + mtp_weight * out["mtp_loss"] * shares[2]
        mtp = mean(out["mtp_loss"].item() * shares[2])
    return loss, mean(out["lm_loss"].item() * shares[1]), mtp, batch["input_ids"].numel()
