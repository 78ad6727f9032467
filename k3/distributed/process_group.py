"""The process group of a multi-process run (SPEC §8) and the small collectives around it.

``init_from_env(device)`` joins the process group torchrun describes (gloo on CPU, NCCL on CUDA);
``collective_device`` says where a small tensor must live for a collective; ``max_logits_across_ranks`` gives
QK-clip the global maximum of every MLA head's logit.
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


def max_logits_across_ranks(max_logit: dict, group=None) -> None:
    """QK-clip must compare the GLOBAL max logit of each head with tau: all-reduce (MAX) what each rank of ``group``
    (default: the world) saw, in place ({layer: [H] fp32}, the same layers on every rank of the group, in one
    order)."""
    if not is_distributed():
        return
    for layer in sorted(max_logit):
        dist.all_reduce(max_logit[layer], op=dist.ReduceOp.MAX, group=group)
