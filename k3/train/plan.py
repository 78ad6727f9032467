"""The contract between the training loop and a parallel plan (SPEC §8): what ``train`` needs from a run's layout.

The loop never imports ``k3.distributed``: the CLI builds ``k3.distributed.plan.ParallelPlan`` (one plan over a
("dp", "ep", "cp") mesh whose sizes may be 1; one process is the plan with every size 1) and passes it in.

One rule makes every layout the same to the loop: each rank backpropagates a loss whose MEAN over all ranks is the
single-process loss of the global batch, and gradients are averaged over all ranks. ``mean`` is that mean: the
average over every rank of the world of a value each rank holds (the identity in one process).
"""

from __future__ import annotations

from typing import NamedTuple, Protocol, runtime_checkable

import torch
from torch import nn


class StepLoss(NamedTuple):
    """One micro-batch's losses. ``loss``: this rank's part, to backpropagate (its mean over the ranks is the
    single-process loss). ``lm_loss``, ``mtp_loss``: the global batch's next-token and MTP losses, detached 0-d
    tensors, the same on every rank (read them after the backward: no wait for the device between forward and
    backward). ``tokens``: tokens of the global batch. ``max_logit``, ``routing``: the forward's statistics
    (``CausalLMOutput``'s, ``k3.layers.stats``) when the step asked for them (``record``), for QK-clip and Quantile
    Balancing."""

    loss: torch.Tensor
    lm_loss: torch.Tensor
    mtp_loss: torch.Tensor | None
    tokens: int
    max_logit: dict | None = None
    routing: dict | None = None


@runtime_checkable
class TrainingPlan(Protocol):
    rank: int  # this process, 0 .. world - 1; rank 0 logs and writes
    world: int  # processes in the run
    device: torch.device  # where this rank's model and batches live
    batch_slices: int  # the global micro-batch is batch_slices x --batch-size sequences

    def shard(self, model: nn.Module) -> None:
        """Lay the model out over the ranks (in place), before the optimiser is built."""

    def loss(self, model: nn.Module, batch: dict, mtp_weight: float, record: tuple[str, ...] = ()) -> StepLoss:
        """This rank's part of the loss of a packed global batch {"input_ids" [1,T], "cu_seqlens" [N+1]}:
        ``placed_loss(model, place(batch), mtp_weight, record)``; ``record``: the statistics to return with it
        (``K3ForCausalLM.forward``'s)."""

    def place(self, batch: dict):
        """This rank's slice of the batch on its device (host work and copies only)."""

    def placed_loss(self, model: nn.Module, placed, mtp_weight: float, record: tuple[str, ...] = ()) -> StepLoss:
        """The loss of a ``place``d batch: device work only (what ``k3.train.graph`` captures)."""

    def reduce_grads(self, model: nn.Module) -> None:
        """After the micro-batches' backwards: finish turning every gradient into the global batch's."""

    def mean(self, x: torch.Tensor) -> torch.Tensor:
        """The average over all ranks of ``x`` (a tensor each rank holds); does not wait for the device."""

    def sync_max_logits(self, max_logit: dict) -> None:
        """QK-clip's per-head max logits ({layer: [H]}, ``StepLoss.max_logit``): the MAX over all ranks, in place."""

    def full_state(self, model: nn.Module) -> dict:
        """The unsharded model state on the CPU, on rank 0 (collective: every rank calls it)."""

    def barrier(self) -> None: ...

    def close(self) -> None: ...
