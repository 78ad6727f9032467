"""Meshes that compose the parallelisms (SPEC §8): data with context parallelism ("dp", "cp"), and data with expert
parallelism and optionally context parallelism ("dp", "ep"[, "cp"]).

``DataContextParallelTraining`` (``--dp D --cp C``, rank = dp_index * C + cp_index): FSDP2 shards the weights over
the "dp" dimension; each "cp" group splits every sequence of its data-parallel slice along time (KCP in the KDA
layers, gathered MLA latents; the MTP layers included). Gradients: FSDP averages over dp, then the cp ranks of a
group sum their shares (each holds the same shard index).

``DataExpertParallelTraining`` (``--dp D --ep R [--cp C]``, rank = (dp_index * R + ep_index) * C + cp_index; ``--ep R``
alone is D = 1, no ``--cp`` is C = 1): every (dp, ep) pair trains on its own slice of the global batch (D*R slices,
as in data parallelism), and the C ranks of a "cp" group split that slice's sequences along time as above. Routed
experts are split over the "ep" row (MoonEP dispatch inside it, each cp rank dispatching its own time segment's
tokens: MoE is per token) and each rank's E/R experts once more over its column, the D*C ranks of the same ep index
(``shard_experts_over_dp``); every other weight is FSDP2-sharded over all D*R*C ranks (torchtitan's "dp_shard" that
includes the ep and cp ranks). All parameters are DTensors of one 1-D mesh of all ranks, so the loop's gradient
clipping and Muon see one mesh.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist

from .context_parallel import cp_model_loss
from .data_parallel import ParallelContext, collective_device, init_from_env, rank_slice, weighted_slice_loss

_CP_LOSS = "_k3_cp_model_loss"  # cp_model_loss bound to the model, registered as an FSDP forward method


def _register_cp_loss(model) -> None:
    """cp_model_loss calls the trunk, the norm, the head (and the embedding for MTP) one by one instead of the root
    forward; run it as a forward method of the (fully_shard-ed) root, so that FSDP gathers the root's own weights
    first (and reduce-scatters their gradients in backward) as it does around model(...)."""
    from torch.distributed.fsdp import register_fsdp_forward_method

    setattr(model, _CP_LOSS, functools.partial(cp_model_loss, model))
    register_fsdp_forward_method(model, _CP_LOSS)


def _cp_slice_loss(model, batch: dict, mtp_weight: float, device, index: int, slices: int, cp_rank: int, cp: int,
                   cp_group):
    """Slice ``index`` of the global batch's ``slices`` equal slices, split along time over ``cp_group`` (this rank
    holds segment ``cp_rank`` of ``cp``). -> (this rank's share of the slice's loss, the shares of the cp ranks
    summing to the slice's loss weighted by its share of the global predictions: shares[1] for the next-token loss,
    shares[2] for the MTP loss (the targets two tokens ahead), as in ``weighted_slice_loss``; the slice's lm loss
    * shares[1]; its MTP loss * shares[2], or None). The two floats are the same on every rank of the cp group."""
    ids, cu, shares = rank_slice(batch, index, slices)
    ids, cu = ids.to(device), cu.to(device)
    T = ids.shape[1]
    n = -(-T // cp)
    start, end = min(cp_rank * n, T), min((cp_rank + 1) * n, T)
    cp_loss = getattr(model, _CP_LOSS, None) or functools.partial(cp_model_loss, model)  # FSDP: the registered one
    if not (mtp_weight and len(model.mtp)):
        view_loss, lm, _ = cp_loss(ids, cu, start, end, 0.0, cp_group)
        return view_loss * shares[1], lm * shares[1], None
    if not (shares[1] and shares[2]):
        raise ValueError("a data-parallel slice has no position with a target 1 or 2 tokens ahead (documents "
                         "of one or two tokens): use longer documents or a larger --batch-size")
    # cp_model_loss returns lm + w' * mtp; with w' = w * shares[2] / shares[1], shares[1] times it is
    # shares[1] * lm + w * shares[2] * mtp, the weighting of weighted_slice_loss (the lm and mtp it returns are
    # the slice's unweighted global means). w' != 0, so every rank runs the MTP layers (their collectives).
    w = mtp_weight * shares[2] / shares[1]
    loss, lm, mtp = cp_loss(ids, cu, start, end, w, cp_group)
    return loss * shares[1], lm * shares[1], mtp * shares[2]


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
        from torch.distributed.fsdp import fully_shard

        for p in model.parameters():
            dist.broadcast(p.data, src=0)
        for layer in list(model.model.layers) + list(model.mtp):
            fully_shard(layer, mesh=self.mesh["dp"])
        fully_shard(model, mesh=self.mesh["dp"])
        _register_cp_loss(model)

    def loss(self, model, batch: dict, mtp_weight: float, device):
        """This dp slice's loss, split over the cp group, each term weighted by the slice's share of the global
        predictions (FSDP averages over dp; ``_cp_slice_loss``)."""
        loss, lm, mtp = _cp_slice_loss(model, batch, mtp_weight, device, self.dp_rank, self.dp, self.cp_rank,
                                       self.cp, self.cp_group)
        return loss, self.dp_mean(lm), None if mtp is None else self.dp_mean(mtp), batch["input_ids"].numel()

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
    """The parallel context ``k3.train.loop.train`` takes for ``k3 train --dp D --ep R [--cp C]`` (D x R x C
    processes, rank = (dp_index * R + ep_index) * C + cp_index; the mesh is ("dp", "ep", "cp"), or ("dp", "ep") when
    C = 1). ``kwargs`` go to ``init_from_env``.

    Gradients. Let S = D*R slices (one per (dp, ep) pair) and W = S*C ranks. One process on the global batch
    minimises L = (1/S) sum_s l_s, l_s the slice's token-mean loss times its share of the global predictions (the
    shares sum to S; ``rank_slice``). Rank (s, c) computes a share l_{s,c} of its slice's loss with
    sum_c l_{s,c} = l_s (``cp_mean_loss``: its targets' CE sum / the slice's target count; l_{s,1} = l_s when
    C = 1) and backpropagates C * l_{s,c}. The CP collectives' backwards (the latent gather's all-reduce, KCP's
    adjoint scan, the conv halos) bring every share's gradient back to the rank that computed the activation, so
    the parameter-gradient contributions g_r computed on the ranks r sum to
    sum_r g_r = C * sum_s grad l_s = C * S * grad L = W * grad L, i.e. grad L = (1/W) * sum_r g_r:
      - FSDP-sharded weights (everything but the routed experts): FSDP's reduce-scatter averages over all W ranks;
        that is grad L only because of the factor C (without it: grad L / C);
      - routed experts: MoonEP's backward returns every ep rank's contribution to the expert's owner in the ep row
        (a sum over the row), the column all-gather's backward reduce-scatters over the D*C ranks of the column
        (a sum over it), so a chunk's gradient is the sum over all W ranks; ``reduce_grads`` divides it by W.
    With C = 1 this is plain data parallelism over the S slices (``weighted_slice_loss``, no factor).

    Quantile Balancing pools its histograms over the world: the slices are disjoint and the cp segments tile each
    slice (the MTP layer's tokens too), so every token of the global batch is counted by exactly one rank.
    """

    def __init__(self, dp: int, ep: int, cp: int = 1, **kwargs):
        from torch.distributed.device_mesh import init_device_mesh

        super().__init__(*init_from_env(**kwargs))
        if self.world != dp * ep * cp:
            what = f"--dp {dp} x --ep {ep}" + (f" x --cp {cp}" if cp > 1 else "")
            raise ValueError(f"{what} needs {dp * ep * cp} processes, {self.world} are running: start them under "
                             f"`torchrun --nproc_per_node {dp * ep * cp} -m k3 train ...`")
        self.dp, self.ep, self.cp = dp, ep, cp
        names = ("dp", "ep", "cp") if cp > 1 else ("dp", "ep")
        self.mesh = init_device_mesh(self.device.type, (dp, ep, cp)[:len(names)], mesh_dim_names=names)
        self.ep_group = self.mesh["ep"].get_group()
        if cp > 1:
            self.cp_group, self.cp_rank = self.mesh["cp"].get_group(), self.mesh["cp"].get_local_rank()
            column = self.mesh["dp", "cp"]._flatten("dp_cp")  # group rank dp_index * C + cp_index
        else:
            self.cp_group, self.cp_rank = None, 0
            column = self.mesh["dp"]
        self.column_group = column.get_group()  # the D*C ranks of this rank's ep index: its experts' shards
        self.flat = self.mesh._flatten("_".join(names))  # all ranks in rank order: FSDP's mesh and the experts'
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
            shard_experts_over_dp(m.experts, self.column_group, self.flat)
        ids = {id(p) for m in moes for p in m.experts.parameters()}
        self._experts = {n: p for n, p in model.named_parameters() if id(p) in ids}
        ignored = set(self._experts.values())
        for layer in list(model.model.layers) + list(model.mtp):
            fully_shard(layer, mesh=self.flat, ignored_params=ignored)
        fully_shard(model, mesh=self.flat, ignored_params=ignored)
        if self.cp > 1:
            _register_cp_loss(model)

    def loss(self, model, batch: dict, mtp_weight: float, device):
        """This rank's part of the loss of slice rank // C (see the class for the factor C)."""
        if self.cp == 1:
            return weighted_slice_loss(model, batch, mtp_weight, device, self.rank, self.world, self.mean)
        loss, lm, mtp = _cp_slice_loss(model, batch, mtp_weight, device, self.rank // self.cp, self.world // self.cp,
                                       self.cp_rank, self.cp, self.cp_group)
        # lm and mtp are the same on the C ranks of a slice: their mean over the world is the mean over the slices
        return (loss * self.cp, self.mean(lm), None if mtp is None else self.mean(mtp),
                batch["input_ids"].numel())

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
