"""Expert load balancing through the router bias b (SPEC §4.1): Quantile Balancing, and DeepSeek-V3's sign rule.

Quantile Balancing: a_i is token i's (k+1)-th largest biased score, r_ij = a_i - s_ij is the bias expert j needs
to enter token i's top-k, and b_j <- the (k/E)-quantile of r_{:,j}, then b -= mean(b). The quantile is read from
integer histograms (B bins over [min(b) - 1, max(b) + 1]) accumulated over micro-batches and summed over ranks in
ONE all-reduce per optimizer step, so the estimate does not depend on how tokens are split or sharded.

Legend: N tokens, E experts, k experts per token, B histogram bins.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn

from ..ops.routing import bincount

__all__ = ["required_bias", "histogram_counts", "quantile_from_histogram", "exact_quantile", "exact_quantile_bias",
           "ExpertBalancer"]

METHODS = ("quantile", "sign")


def required_bias(scores: torch.Tensor, bias: torch.Tensor, k: int) -> torch.Tensor:
    """scores [N,E], bias [E] -> r [N,E] fp32: r_ij = a_i - s_ij, a_i the (k+1)-th largest of s_i + b."""
    N, E = scores.shape
    if not 0 < k < E:
        raise ValueError(f"top-k must satisfy 0 < k < E to have a (k+1)-th expert; got k={k}, E={E}")
    if bias.shape != (E,):
        raise ValueError(f"bias must be [E] = [{E}] to match scores {tuple(scores.shape)}; got {tuple(bias.shape)}")
    scores = scores.float()
    a = (scores + bias.float()).topk(k + 1, dim=-1).values[:, -1:]  # [N,1]
    return a - scores


def histogram_counts(r: torch.Tensor, lo, hi, bins: int) -> torch.Tensor:
    """r [N,E] -> int64 [E,B]: per-expert counts in B equal bins over [lo, hi); outside values go to the end bins.
    ``lo``/``hi``: floats, or 0-d tensors on r's device (never read back: no wait for the device)."""
    if not isinstance(lo, torch.Tensor) and not isinstance(hi, torch.Tensor) and not hi > lo:
        raise ValueError(f"histogram range must have hi > lo; got [{lo}, {hi}]")
    N, E = r.shape
    b = ((r - lo) * (bins / (hi - lo))).floor_().clamp_(0, bins - 1).long()  # [N,E]
    b += torch.arange(E, device=r.device) * bins  # one flat bin space for all experts
    return bincount(b, E * bins).view(E, bins)


def quantile_from_histogram(counts: torch.Tensor, lo, hi, q: float) -> torch.Tensor:
    """counts [...,E,B] -> [...,E] fp32: the value below which a fraction q of the counted values fall, with the
    mass of each bin spread uniformly over it (linear interpolation). Experts with no counts give NaN.
    ``lo``/``hi`` are floats or tensors broadcastable to [...]."""
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"quantile level must be in [0, 1]; got {q}")
    bins = counts.shape[-1]
    cum = counts.cumsum(-1).double()  # [...,E,B]
    target = q * cum[..., -1:]  # [...,E,1]
    j = torch.searchsorted(cum, target).clamp_(max=bins - 1)  # first bin with cum >= target
    in_bin = counts.gather(-1, j).double()
    before = cum.gather(-1, j) - in_bin
    frac = ((target - before) / in_bin.clamp(min=1)).clamp_(0, 1)
    pos = (j.double() + frac).squeeze(-1)  # [...,E] in bin units
    if isinstance(lo, torch.Tensor) or isinstance(hi, torch.Tensor):
        lo, hi = (torch.as_tensor(v, dtype=torch.float64, device=counts.device) for v in (lo, hi))
        value = lo.unsqueeze(-1) + pos * ((hi - lo) / bins).unsqueeze(-1)
    else:  # Python floats stay scalars: no host-to-device copy (a wait on CUDA) per layer
        value = float(lo) + pos * ((float(hi) - float(lo)) / bins)
    return value.float().masked_fill(cum[..., -1] == 0, math.nan)


def exact_quantile(r: torch.Tensor, q: float) -> torch.Tensor:
    """r [N,E] -> [E]: the ceil(qN)-th smallest r per expert (the value at which a fraction q is reached); the
    histogram estimate of the same q lies in the same bin, hence within one bin width of it."""
    N = r.shape[0]
    i = min(max(math.ceil(q * N), 1), N) - 1
    return r.sort(dim=0).values[i]


def exact_quantile_bias(scores: torch.Tensor, bias: torch.Tensor, k: int) -> torch.Tensor:
    """One Quantile Balancing update from sorted r instead of histograms: scores [N,E], bias [E] -> new bias [E]."""
    b = exact_quantile(required_bias(scores, bias, k), k / scores.shape[1])
    return b - b.mean()


class ExpertBalancer:
    """Keeps every MoE layer's router bias balanced; call observe(out.routing) after each micro-batch forward (a
    forward with ``record=("routing",)``, ``k3.layers.stats``), step() once
    per optimizer step (the new bias applies from the next step on); or update() there, which leaves its load
    statistics on the device to be read with the step's other figures (``Trainer``), and load_stats() on them.

    ``source`` is a model (every LatentMoE in it is found; observe() takes the forward's routing dict) or a list of routers
    (anything with ``e_score_correction_bias`` [E] and ``top_k``; pass the routing to observe() yourself).
    ``group`` is the data-parallel process group whose tokens are pooled (default: the whole world); under
    torch.distributed every rank of it must call step() (or update()), which holds the one collective.
    """

    def __init__(self, source: nn.Module | list, method: str = "quantile", bins: int = 1000, gamma: float = 1e-3,
                 group=None):
        from ..layers.width.latent_moe import LatentMoE  # train sits above layers

        if method not in METHODS:
            raise ValueError(f"unknown balancing method {method!r}; expected one of {METHODS}")
        if bins < 2:
            raise ValueError(f"the quantile histogram needs at least 2 bins; got bins={bins}")
        if isinstance(source, nn.Module):
            self.moes = [m for m in source.modules() if isinstance(m, LatentMoE)]
            if not self.moes:
                raise ValueError("the model has no LatentMoE layer: there is no router bias to balance")
            self.routers = [m.gate for m in self.moes]
        else:
            self.moes, self.routers = None, list(source)
            if not self.routers:
                raise ValueError("ExpertBalancer needs a model or a non-empty list of routers")
        self.method, self.bins, self.gamma, self.group = method, bins, gamma, group
        self.steps = 0
        self._reset()

    # accumulation, per micro-batch

    def _reset(self) -> None:
        biases = [r.e_score_correction_bias for r in self.routers]
        E_dev = [(b.numel(), b.device) for b in biases]
        nb = self.bins if self.method == "quantile" else 0
        self.hist = [torch.zeros(E, nb, dtype=torch.int64, device=d) for E, d in E_dev]  # [E,B] per layer
        self.loads = [torch.zeros(E, dtype=torch.int64, device=d) for E, d in E_dev]  # [E] per layer
        self.bounds: torch.Tensor | None = None  # [layers, 2] fp64 histogram ranges, set by the step's first observe

    @torch.no_grad()
    def observe(self, routing: list | dict) -> None:
        """Adds one micro-batch. ``routing``: per layer (scores [N,E], idx [N,k]) or None to skip that layer; built
        from a model, the forward's ``CausalLMOutput.routing`` ({LatentMoE layer index: (scores, idx)}) instead."""
        if isinstance(routing, dict):
            if self.moes is None:
                raise ValueError("built from routers: pass observe() a list of (scores, idx), one per router")
            routing = [routing.get(m.layer_idx) for m in self.moes]
        if len(routing) != len(self.routers):
            raise ValueError(f"got routing for {len(routing)} layers; this balancer manages {len(self.routers)}")
        if all(x is None for x in routing):
            raise RuntimeError("no MoE layer recorded routing: call observe() after a forward pass of the model")
        for l, x in enumerate(routing):
            if x is None:  # e.g. the MTP layer on a forward without labels
                continue
            scores, idx = x
            router = self.routers[l]
            self.loads[l] += bincount(idx, self.loads[l].numel())
            if self.method == "quantile":
                r = required_bias(scores, router.e_score_correction_bias, router.top_k)  # [N,E]
                self.hist[l] += histogram_counts(r, *self._range(l), self.bins)

    def _range(self, l: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer l's histogram range for this step, [min(b) - 1, max(b) + 1] from its bias at the step's start: r
        lies in it (s in (0,1)). 0-d fp64 tensors on the device: built once per step for every layer, never read
        back (no wait for the device in the middle of a step). The biases have not moved since the last step(), so
        every rank gets the same."""
        if self.bounds is None:
            ext = torch.stack([torch.stack([r.e_score_correction_bias.min(), r.e_score_correction_bias.max()])
                               for r in self.routers]).double()  # [layers, 2]
            self.bounds = torch.stack([ext[:, 0] - 1.0, ext[:, 1] + 1.0], dim=1)
        return self.bounds[l, 0], self.bounds[l, 1]

    # the update, per optimizer step

    def _all_reduce(self) -> None:
        """Sums every layer's histogram and load counts over ranks in one integer all-reduce."""
        if not (dist.is_available() and dist.is_initialized()):
            return
        parts = self.hist + self.loads
        flat = torch.cat([p.flatten() for p in parts])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.group)
        for p, v in zip(parts, flat.split([p.numel() for p in parts])):
            p.copy_(v.view_as(p))

    @torch.no_grad()
    def update(self) -> torch.Tensor:
        """Updates every router's bias from the pooled counts, on the device (nothing is read back, so the host
        goes on queueing work); returns the step's load statistics, [layers, 2] fp64 on the device: each layer's
        routed-token count and max/mean expert load (under the bias that was in effect during the step).
        ``load_stats`` turns them, read, into ``step``'s dict."""
        self._all_reduce()
        stats = torch.stack([torch.stack([c.sum().double(), c.max().double() / c.double().mean()])
                             for c in self.loads])
        for l, router in enumerate(self.routers):
            loads = self.loads[l].double()  # [E]
            bias = router.e_score_correction_bias
            if self.method == "quantile":
                b = quantile_from_histogram(self.hist[l], *self._range(l), router.top_k / bias.numel())
                new = b - b.mean()
            else:
                new = bias + self.gamma * torch.sign(loads.mean() - loads).to(bias)
            bias.copy_(torch.where(stats[l, 0] > 0, new, bias))  # a layer that ran no tokens keeps its bias
        self.steps += 1
        self._reset()
        return stats

    @staticmethod
    def load_stats(stats: list) -> dict:
        """``update``'s statistics read back (a list of [count, max/mean] per layer) -> {"load_max_over_mean":
        worst layer, "per_layer": [...] (NaN for a layer that ran no tokens)}."""
        if all(total == 0 for total, _ in stats):
            raise RuntimeError("step() found no observed tokens since the last step: call observe() after each "
                               "micro-batch forward")
        per_layer = [ratio if total else math.nan for total, ratio in stats]
        return {"load_max_over_mean": max(x for x in per_layer if not math.isnan(x)), "per_layer": per_layer}

    def step(self) -> dict:
        """``update`` and its statistics read at once (``load_stats``)."""
        return self.load_stats(self.update().tolist())

    # checkpointing

    def state_dict(self) -> dict:
        return {"method": self.method, "bins": self.bins, "steps": self.steps, "bounds": self.bounds,
                "hist": [h.clone() for h in self.hist], "loads": [c.clone() for c in self.loads]}

    def load_state_dict(self, state: dict) -> None:
        if (state["method"], state["bins"]) != (self.method, self.bins):
            raise ValueError(f"balancer state is for method={state['method']!r}, bins={state['bins']}; this "
                             f"balancer has method={self.method!r}, bins={self.bins}")
        if len(state["loads"]) != len(self.routers):
            raise ValueError(f"balancer state has {len(state['loads'])} layers; this model has {len(self.routers)}")
        for mine, theirs in zip(self.hist + self.loads, state["hist"] + state["loads"]):
            if mine.shape != theirs.shape:
                raise ValueError(f"balancer state tensor of shape {tuple(theirs.shape)}; expected {tuple(mine.shape)}")
            mine.copy_(theirs)
        bounds = state.get("bounds")  # older states hold "ranges" instead: None between steps, as here
        self.steps = state["steps"]
        self.bounds = None if bounds is None else bounds.to(self.routers[0].e_score_correction_bias.device)
