"""Two-dimensional meshes (SPEC §8): data parallelism composed with context parallelism ("dp", "cp") or with
expert parallelism ("dp", "ep"). Rank = dp_index * C + c_index, C the size of the second dimension.

``DataContextParallelTraining`` (``--dp D --cp C``): FSDP2 shards the weights over the "dp" dimension; each "cp"
group splits every sequence of its data-parallel slice along time (KCP in the KDA layers, gathered MLA latents;
the MTP layers included). Gradients: FSDP averages over dp, then the cp ranks of a group sum their shares (each
holds the same shard index).

``DataExpertParallelTraining`` (``--dp D --ep R``): every rank trains on its own slice of the global batch (D*R
slices, as in data parallelism). Routed experts are split over the "ep" row (MoonEP dispatch inside it) and each
rank's E/R experts once more over the "dp" column (``shard_experts_over_dp``); every other weight is FSDP2-sharded
over all D*R ranks (torchtitan's "dp_shard" that includes the ep ranks). All parameters are DTensors of one 1-D
mesh of the D*R ranks, so the loop's gradient clipping and Muon see one mesh.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist

from .context_parallel import cp_model_loss
from .data_parallel import ParallelContext, collective_device, init_from_env, rank_slice, weighted_slice_loss

_CP_LOSS = "_k3_cp_model_loss"  # cp_model_loss bound to the model, registered as an FSDP forward method


class DataContextParallelTraining(ParallelContext):
    """The parallel context ``k3.train.loop.train`` takes for ``k3 train --dp D --cp C`` (D x C processes).
    ``kwargs`` go to ``init_from_env``."""

    def __init__(self, dp: int, cp: int, **kwargs):
        from torch.distributed.device_mesh import init_device_mesh

        super().__init__(*init_from_env(**kwargs))
        if self.world != dp * cp:
            raise ValueError(f"--dp {dp} x --cp {cp} needs {dp * cp} processes, {self.world} are running: start them "
                             f"under `torchrun --nproc_per_node {dp * cp} -m k3 train ...`")
        self.dp, self.cp = dp, cp
        self.mesh = init_device_mesh(self.device.type, (dp, cp), mesh_dim_names=("dp", "cp"))
        self.dp_group, self.cp_group = self.mesh["dp"].get_group(), self.mesh["cp"].get_group()
        self.dp_rank, self.cp_rank = self.mesh["dp"].get_local_rank(), self.mesh["cp"].get_local_rank()

    def shard(self, model) -> None:
        from torch.distributed.fsdp import fully_shard, register_fsdp_forward_method

        for p in model.parameters():
            dist.broadcast(p.data, src=0)
        for layer in list(model.model.layers) + list(model.mtp):
            fully_shard(layer, mesh=self.mesh["dp"])
        fully_shard(model, mesh=self.mesh["dp"])
        # With MTP, cp_model_loss calls the trunk, the norm, the head and the embedding one by one instead of the
        # root forward; run it as a forward method of the root, so that FSDP gathers the root's own weights first
        # (and reduce-scatters their gradients in backward) as it does around model(...).
        setattr(model, _CP_LOSS, functools.partial(cp_model_loss, model))
        register_fsdp_forward_method(model, _CP_LOSS)

    def loss(self, model, batch: dict, mtp_weight: float, device):
        """This dp slice's loss, split over the cp group, each term weighted by the slice's share of the global
        predictions (FSDP averages over dp): shares[1] for the next-token loss, shares[2] for the MTP loss (the
        targets two tokens ahead), as in ``weighted_slice_loss``."""
        ids, cu, shares = rank_slice(batch, self.dp_rank, self.dp)
        ids, cu = ids.to(device), cu.to(device)
        T = ids.shape[1]
        n = -(-T // self.cp)
        start, end = min(self.cp_rank * n, T), min((self.cp_rank + 1) * n, T)
        if not (mtp_weight and len(model.mtp)):
            view_loss, lm, _ = cp_model_loss(model, ids, cu, start, end, 0.0, self.cp_group)
            return view_loss * shares[1], self.dp_mean(lm * shares[1]), None, batch["input_ids"].numel()
        if not (shares[1] and shares[2]):
            raise ValueError("a data-parallel slice has no position with a target 1 or 2 tokens ahead (documents "
                             "of one or two tokens): use longer documents or a larger --batch-size")
        # cp_model_loss returns lm + w' * mtp; with w' = w * shares[2] / shares[1], shares[1] times it is
        # shares[1] * lm + w * shares[2] * mtp, the weighting of weighted_slice_loss (the lm and mtp it returns are
        # the slice's unweighted global means). w' != 0, so every rank runs the MTP layers (their collectives).
        w = mtp_weight * shares[2] / shares[1]
        loss, lm, mtp = getattr(model, _CP_LOSS)(ids, cu, start, end, w, self.cp_group)
        return (loss * shares[1], self.dp_mean(lm * shares[1]), self.dp_mean(mtp * shares[2]),
                batch["input_ids"].numel())

    def dp_mean(self, x: float) -> float:
        t = torch.tensor([x], dtype=torch.float64, device=collective_device(self.dp_group))  # NCCL: on the GPU
        dist.all_reduce(t, group=self.dp_group)
        return float(t) / self.dp

    def reduce_grads(self, model) -> None:
        for p in model.parameters():
            if p.grad is not None:
                g = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
                dist.all_reduce(g, group=self.cp_group)

    def mean(self, x: float) -> float:
        return x  # loss() already returns the global value


class DataExpertParallelTraining(ParallelContext):
    """The parallel context ``k3.train.loop.train`` takes for ``k3 train --dp D --ep R`` (D x R processes, rank =
    dp_index * R + ep_index). ``kwargs`` go to ``init_from_env``.

    Gradients (each rank's loss is its slice's token mean times its share of the global predictions, the shares
    summing to D*R, so the single-process gradient is (1/(D*R)) * the sum over ranks of their gradients):
      - FSDP-sharded weights (everything but the routed experts): FSDP's reduce-scatter averages over all D*R ranks;
      - routed experts: MoonEP's backward returns every ep rank's contribution to the expert's owner in the ep row
        (a sum over the row), the dp all-gather's backward reduce-scatters over the dp column (a sum over the
        column), so a chunk's gradient is the sum over all D*R ranks; ``reduce_grads`` divides it by D*R.
    """

    def __init__(self, dp: int, ep: int, **kwargs):
        from torch.distributed.device_mesh import init_device_mesh

        super().__init__(*init_from_env(**kwargs))
        if self.world != dp * ep:
            raise ValueError(f"--dp {dp} x --ep {ep} needs {dp * ep} processes, {self.world} are running: start them "
                             f"under `torchrun --nproc_per_node {dp * ep} -m k3 train ...`")
        self.dp, self.ep = dp, ep
        self.mesh = init_device_mesh(self.device.type, (dp, ep), mesh_dim_names=("dp", "ep"))
        self.dp_group, self.ep_group = self.mesh["dp"].get_group(), self.mesh["ep"].get_group()
        self.flat = self.mesh._flatten("dp_ep")  # all ranks in rank order: FSDP's mesh and the experts'
        self._experts: dict[str, torch.nn.Parameter] = {}

    def shard(self, model) -> None:
        from torch.distributed.fsdp import fully_shard

        from ..layers.width.latent_moe import LatentMoE
        from .expert_parallel import parallelize_moe, shard_experts_over_dp

        for p in model.parameters():  # identical replicas before anything is split
            dist.broadcast(p.data, src=0)
        moes = [m for m in model.modules() if isinstance(m, LatentMoE)]
        if not moes:
            raise ValueError("--ep needs a model with MoE layers")
        for m in moes:
            parallelize_moe(m, group=self.ep_group)
            shard_experts_over_dp(m.experts, self.dp_group, self.flat)
        ids = {id(p) for m in moes for p in m.experts.parameters()}
        self._experts = {n: p for n, p in model.named_parameters() if id(p) in ids}
        ignored = set(self._experts.values())
        for layer in list(model.model.layers) + list(model.mtp):
            fully_shard(layer, mesh=self.flat, ignored_params=ignored)
        fully_shard(model, mesh=self.flat, ignored_params=ignored)

    def loss(self, model, batch: dict, mtp_weight: float, device):
        return weighted_slice_loss(model, batch, mtp_weight, device, self.rank, self.world, self.mean)

    def reduce_grads(self, model) -> None:
        """FSDP already averaged its weights' gradients; the experts hold the sum over all ranks (see the class)."""
        for p in self._experts.values():
            if p.grad is not None:
                p.grad.div_(self.world)

    def full_state(self, model) -> dict:
        """Full tensors (on CPU) of every weight and buffer, experts in their true order (collective)."""
        from torch.distributed.tensor import DTensor

        from .expert_parallel import unpermute_experts

        state = {}
        for name, t in model.state_dict().items():
            if isinstance(t, DTensor):
                t = t.full_tensor()
            if name in self._experts:
                t = unpermute_experts(t, self.dp, self.ep)
            state[name] = t.detach().cpu()
        return state


__all__ = ["DataContextParallelTraining", "DataExpertParallelTraining"]
