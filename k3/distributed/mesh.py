"""Data parallelism composed with context parallelism on a 2-D DeviceMesh ("dp", "cp") (SPEC §8).

FSDP2 shards the weights over the "dp" dimension; each "cp" group splits every sequence of its data-parallel
slice along time (KCP in the KDA layers, gathered MLA latents). Gradients: FSDP averages over dp, then the cp
ranks of a group sum their shares (each holds the same shard index). Rank = dp_index * cp + cp_index.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .context_parallel import cp_model_loss
from .data_parallel import ParallelContext, init_from_env, rank_slice


class DataContextParallelTraining(ParallelContext):
    """The parallel context ``k3.train.loop.train`` takes for ``k3 train --dp D --cp C`` (D x C processes)."""

    def __init__(self, dp: int, cp: int):
        from torch.distributed.device_mesh import init_device_mesh

        super().__init__(*init_from_env())
        if self.world != dp * cp:
            raise ValueError(f"--dp {dp} x --cp {cp} needs {dp * cp} processes, {self.world} are running")
        self.dp, self.cp = dp, cp
        self.mesh = init_device_mesh(self.device.type, (dp, cp), mesh_dim_names=("dp", "cp"))
        self.dp_group, self.cp_group = self.mesh["dp"].get_group(), self.mesh["cp"].get_group()
        self.dp_rank, self.cp_rank = self.mesh["dp"].get_local_rank(), self.mesh["cp"].get_local_rank()

    def shard(self, model) -> None:
        from torch.distributed.fsdp import fully_shard

        for p in model.parameters():
            dist.broadcast(p.data, src=0)
        for layer in list(model.model.layers) + list(model.mtp):
            fully_shard(layer, mesh=self.mesh["dp"])
        fully_shard(model, mesh=self.mesh["dp"])

    def loss(self, model, batch: dict, mtp_weight: float, device):
        ids, cu, shares = rank_slice(batch, self.dp_rank, self.dp)
        ids, cu = ids.to(device), cu.to(device)
        T = ids.shape[1]
        n = -(-T // self.cp)
        start, end = min(self.cp_rank * n, T), min((self.cp_rank + 1) * n, T)
        if mtp_weight and len(model.mtp):
            raise ValueError("--dp x --cp with MTP is not implemented: pass --mtp-weight 0 (or use --cp alone)")
        # this dp slice's loss, split over the cp group; weighted by the slice's share (FSDP averages over dp)
        view_loss, lm, _ = cp_model_loss(model, ids, cu, start, end, 0.0, self.cp_group)
        return view_loss * shares[1], self.dp_mean(lm * shares[1]), None, batch["input_ids"].numel()

    def dp_mean(self, x: float) -> float:
        t = torch.tensor([x], dtype=torch.float64)
        dist.all_reduce(t, group=self.dp_group)
        return float(t) / self.dp

    def reduce_grads(self, model) -> None:
        for p in model.parameters():
            if p.grad is not None:
                g = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
                dist.all_reduce(g, group=self.cp_group)

    def mean(self, x: float) -> float:
        return x  # loss() already returns the global value


__all__ = ["DataContextParallelTraining"]
