"""Activation memory policies (SPEC §8; the report's unified activation manager): every tensor autograd saves for
the backward goes through a storage policy, chosen per tensor, outside the model code.

Storage kinds:
  keep       the tensor stays where it is (autograd's default);
  recompute  not stored: the region it was saved in runs again from the region's inputs in the backward
             (``torch.utils.checkpoint``, non-reentrant);
  offload    copied to host memory in the forward (pinned, asynchronous on CUDA) and back in the backward.

The choice per saved tensor comes from light annotations: the innermost named region it was saved in
(``k3.ops.regions``: "attn_res", "moe_experts"), else whether it was saved inside a decoder layer ("layer"),
its size (``offload_min_bytes``), and whether it is a weight (weights are never moved). Policies:

  keep       everything kept.
  efficient  the report's memory-efficient AttnRes and MoE: every AttnRes mix and every MoE's routed dispatch,
             expert matmuls and combine are recomputed in the backward. Their inputs are the depth sources (built
             once per block and shared) and the dispatch input (the latent rows, routing weights and indices), so
             a layer saves what a plain residual layer with a dense FFN-sized input saves.
  offload    efficient, plus every other activation of >= 1 MiB saved inside a decoder layer offloaded to host
             memory.
  recompute  whole decoder layers recomputed: only each layer's inputs (the depth sources) are kept.

Every policy gives the loss of ``keep`` exactly (recomputation repeats the same operations, offloading moves exact
copies) and its gradients to float rounding (a recomputed region may change the order in which autograd sums a
tensor's gradient contributions): tests/train/test_memory.py. ``ActivationManager.forward()`` also measures what the policy
keeps on the device, through the same hooks (``SavedStats``), deterministically, on any device.
"""

from __future__ import annotations

import weakref
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint
from torch.utils.weak import WeakIdKeyDictionary

from ..ops.regions import REGIONS, region_handler

__all__ = ["MemoryPolicy", "POLICIES", "SavedStats", "ActivationManager"]

STORAGE = ("keep", "recompute", "offload")


@dataclass(frozen=True)
class MemoryPolicy:
    """regions: region name -> storage of what it saves; layers: storage of everything else a decoder layer saves
    (recompute = the whole layer); offload_min_bytes: smaller tensors are kept even where the storage is offload."""

    regions: dict = field(default_factory=dict)
    layers: str = "keep"
    offload_min_bytes: int = 1 << 20

    def __post_init__(self):
        for name, storage in self.regions.items():
            if name not in REGIONS or storage not in STORAGE:
                raise ValueError(f"memory policy region {name!r}: {storage!r}; regions are {REGIONS}, storage kinds "
                                 f"{STORAGE}")
        if self.layers not in STORAGE:
            raise ValueError(f"memory policy layers: {self.layers!r}; expected one of {STORAGE}")
        if self.layers == "recompute" and any(s == "recompute" for s in self.regions.values()):
            raise ValueError("recomputing whole layers already recomputes their regions: choose one")


_EFFICIENT = {"attn_res": "recompute", "moe_experts": "recompute"}
POLICIES = {
    "keep": MemoryPolicy(),
    "efficient": MemoryPolicy(_EFFICIENT),
    "offload": MemoryPolicy(_EFFICIENT, layers="offload"),
    "recompute": MemoryPolicy(layers="recompute"),
}


def _is_weight(t: torch.Tensor) -> bool:
    base = t._base if t._base is not None else t
    return isinstance(base, nn.Parameter) or (base.is_leaf and base.requires_grad)


def _nbytes(t: torch.Tensor) -> int:
    return t.untyped_storage().nbytes()


@dataclass
class SavedStats:
    """What one forward left for the backward as the policy stores it, weights excluded, measured when the forward
    ends (where training memory peaks): ``kept_bytes`` on the device (each storage once: views and repeats of one
    tensor share it; tensors freed before the end, e.g. of discarded side computations, not counted), of which
    ``recompute_input_bytes`` are the inputs of recomputed regions (``torch.utils.checkpoint`` saves a region's
    inputs through the same hooks); ``offloaded_bytes`` copied to host memory."""

    kept_bytes: int = 0
    offloaded_bytes: int = 0
    recompute_input_bytes: int = 0
    _refs: list = field(default_factory=list, repr=False)
    _input_storages: set = field(default_factory=set, repr=False)  # data pointers of recomputed regions' inputs

    def keep(self, t: torch.Tensor, recompute_input: bool = False) -> None:
        if recompute_input:  # (the region's checkpoint saves it too, so its storage lives to the end of the forward)
            self._input_storages.add(t.untyped_storage().data_ptr())
        else:
            self._refs.append(weakref.ref(t))

    def live_bytes(self) -> int:
        """What is kept right now (each storage once), while the forward runs: a pipeline stage reads it after each
        micro-batch's forward, where its memory peaks with several micro-batches in flight."""
        live = {}
        for ref in self._refs:
            t = ref()
            if t is not None and t.untyped_storage().data_ptr():
                live[t.untyped_storage().data_ptr()] = _nbytes(t)
        return sum(live.values())

    def _finish(self) -> None:
        kept = {}
        for ref in self._refs:
            t = ref()
            if t is None:
                continue
            ptr = t.untyped_storage().data_ptr()  # all alive: one pointer, one storage
            if ptr:
                kept[ptr] = _nbytes(t)
        self.kept_bytes = sum(kept.values())
        self.recompute_input_bytes = sum(n for p, n in kept.items() if p in self._input_storages)
        self._refs, self._input_storages = [], set()


def _host_copy(base: torch.Tensor, target: torch.device) -> torch.Tensor:
    """``base`` (a tensor that is no view) copied to ``target`` with its own sizes and strides."""
    pin = base.device.type == "cuda"
    host = torch.empty_strided(base.size(), base.stride(), dtype=base.dtype, device=target, pin_memory=pin)
    return host.copy_(base, non_blocking=pin)  # the device's stream orders the copy before the memory is reused


class _Offloaded:
    """A saved tensor as a view of its base's copy in host memory; ``restore`` brings the view back to its device.
    Tensors saved several times (an input read by three projections) or views of one base share one copy."""

    __slots__ = ("host", "view", "device")

    def __init__(self, host_base: torch.Tensor, t: torch.Tensor, base: torch.Tensor):
        self.host, self.device = host_base, t.device
        self.view = (t.size(), t.stride(), t.storage_offset() - base.storage_offset())

    def restore(self) -> torch.Tensor:
        return self.host.as_strided(*self.view).to(self.device, non_blocking=True)


class ActivationManager:
    """Applies a ``MemoryPolicy`` to a K3ForCausalLM: ``attach(model)`` once, then run each training forward inside
    ``with manager.forward() as stats:`` (the backward may run after the block: saved tensors remember their
    storage)."""

    def __init__(self, policy: str | MemoryPolicy = "keep", offload_device: str | torch.device = "cpu"):
        if isinstance(policy, str):
            if policy not in POLICIES:
                raise ValueError(f"unknown memory policy {policy!r}; expected one of {sorted(POLICIES)}")
            policy = POLICIES[policy]
        self.policy, self.offload_device = policy, torch.device(offload_device)
        self.stats = SavedStats()
        self._active = False
        self._where: list[str] = []  # storage of the enclosing layers / regions, innermost last
        self._host = WeakIdKeyDictionary()

    def attach(self, model: nn.Module) -> None:
        from ..model.block import DecoderLayer
        from ..model.transformer import K3Model

        for m in model.modules():
            if self.policy.layers == "recompute" and isinstance(m, K3Model):  # a K3ForCausalLM's or a multimodal one's
                m.gradient_checkpointing = True  # k3's own layer recompute (K3Model.forward)
            if isinstance(m, DecoderLayer):
                m.register_forward_pre_hook(self._enter_layer)
                m.register_forward_hook(self._leave_layer, always_call=True)

    @contextmanager
    def forward(self, measure: bool = True):
        """The training forward of one micro-batch: -> its SavedStats (left empty with ``measure=False``, when
        the policy then needs no hook at all: ``keep`` runs as plain autograd, with no Python call per tensor)."""
        if not measure and not self.policy.regions and self.policy.layers in ("keep", "recompute"):
            yield SavedStats()
            return
        self.stats, self._active, self._where = SavedStats(), True, []
        self._host = WeakIdKeyDictionary()  # base tensor -> (its host copy, its version), while it lives
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack), region_handler(self._region):
                yield self.stats
            self.stats._finish()
        finally:
            self._active = False

    def _enter_layer(self, layer, args) -> None:
        if not self._active:  # a recompute in the backward, or no training forward
            return
        self._where.append(self.policy.layers)

    def _leave_layer(self, layer, args, output) -> None:
        if self._active and self._where:
            self._where.pop()

    def _pack(self, t: torch.Tensor):
        if _is_weight(t):
            return t
        storage = self._where[-1] if self._where else "keep"
        if storage == "offload" and _nbytes(t) >= self.policy.offload_min_bytes:
            base = t._base if t._base is not None else t
            host, version = self._host.get(base, (None, None))
            if host is None or version != base._version:  # first save, or changed in place since
                host = _host_copy(base, self.offload_device)
                self._host[base] = (host, base._version)
                self.stats.offloaded_bytes += _nbytes(host)
            return _Offloaded(host, t, base)
        # a detached alias (same storage and version counter), not ``t``: a node that saves its own output would
        # otherwise hold ``t``, which holds the node (its grad_fn), a cycle through C++ that Python's collector
        # cannot see; a backward breaks it by freeing the saved tensors, but a forward that fails (out of memory)
        # or is never differentiated would keep every activation of the step alive
        t = t.detach()
        self.stats.keep(t)
        return t

    @staticmethod
    def _unpack(x):
        return x.restore() if isinstance(x, _Offloaded) else x

    def _region(self, name: str, fn, *args):
        storage = self.policy.regions.get(name)  # None: as the enclosing layer
        if storage is None:
            return fn(*args)
        if storage == "recompute":
            for a in () if torch.compiler.is_compiling() else args:  # (compiled: inside a graph, no bookkeeping)
                if isinstance(a, torch.Tensor) and not _is_weight(a):  # checkpoint saves them through _pack too
                    self.stats.keep(a, recompute_input=True)
            # no random numbers in a region: nothing to save and restore around the recompute
            return checkpoint(fn, *args, use_reentrant=False, preserve_rng_state=False)
        self._where.append(storage)
        try:
            return fn(*args)
        finally:
            self._where.pop()
