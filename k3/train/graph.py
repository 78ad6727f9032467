"""The training step's forward and backward as one CUDA graph (``k3 train --cuda-graph``): captured once, then
replayed for every micro-batch, so the host issues one launch per micro-batch instead of the ~6,000 kernels
(fla's launchers, the compiled regions' guards, autograd's nodes) that bound a small model's step.

What is recorded: ``plan.placed_loss`` of a placed micro-batch under autocast, and its backward (the activation
memory policy's hooks included). What stays eager: the copy of each batch into the graph's input buffers,
gradient accumulation over micro-batches, clipping, the optimiser and the schedule (the learning rate is a Python
number the optimiser reads each step), Quantile Balancing and QK-clip.

Packed documents without a fixed layout. The layers plan their kernels from cu_seqlens (``k3.ops.varlen.
cached_plan``), normally from its host values. Under a graph the boundaries are data instead: the graph is
captured for a ``Capacity`` (the token shape and a number of document slots), and every plan a layer asks of the
graph's cu_seqlens has a fixed shape and is rebuilt in place on the device before each replay from the padded
cu_seqlens (one pinned copy of S + 1 integers, ``device_document_starts``):
  - cu_seqlens itself, padded with empty documents to the slots (fla's KDA builds its chunk list on the device
    from it, ``use_graph``, in a fixed shape, skipping the spare rows);
  - MLA's flash varlen call takes the row's length as its maximum (the spare documents and blocks exit at once);
  - QK-clip's max-logit kernel and the short conv's kernels read each position's document start, [T].
A plan of any other kind would need host values the graph does not have: the capture fails saying so. A micro-
batch beyond the capacity (more documents, another token shape) is captured again, for a capacity that covers both
(the slots only grow, so a run captures a few times at most).

Other rules a replay depends on, checked here rather than assumed:
  - the gradients: captured with ``.grad`` None, the backward writes fresh gradients into the graph's memory on
    every replay (so they are never zeroed or set to None afterwards: the optimiser reads them there);
  - device work only: one process (no collectives), no offload policy (host copies), the default loss (a caller's
    own loss function may read the device), text batches;
  - the forward's statistics (``record``: QK-clip's ``max_logit``, the routing for balancing, in the StepLoss) are
    the graph's output memory, rewritten by every replay: the trainer reads them before the next replay (the
    balancer's observe, in stream order) or copies them (the max logits' running maximum over the micro-batches).

Two extra forwards and backwards run per capture, eagerly on the capture stream before capturing, as PyTorch's
whole-network capture does (lazy initialisation, autotuning and compilation outside the graph): the first measures
what the policy saves, through hooks the compiled regions are guarded on, the second is the captured code itself.
Their gradients are discarded.
Memory: the graph keeps its activations' pool between steps, so the optimiser's temporaries come on top of the
activation peak instead of reusing it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from ..ops import varlen

__all__ = ["StepGraph", "Capacity", "graph_unsupported", "layout", "device_document_starts"]

_TEXT_KEYS = {"input_ids", "cu_seqlens", "labels"}


def graph_unsupported(device: torch.device, world: int, policy) -> str | None:
    """Why a run on ``device`` over ``world`` processes under the ``MemoryPolicy`` ``policy`` cannot capture its
    step, or None."""
    if device.type != "cuda":
        return f"CUDA graphs need a CUDA device; this run is on {device} (drop --cuda-graph)"
    if world > 1:
        return (f"the step is captured in one process only; this run has {world} (its collectives are not "
                "recorded): drop --cuda-graph under torchrun")
    if policy.layers == "offload" or "offload" in policy.regions.values():
        return "the memory policy offloads activations to host memory, which a graph cannot replay: use " \
               "--memory-policy keep, efficient or recompute with --cuda-graph"
    return None


def layout(batch: dict) -> tuple[tuple, list[int]]:
    """(the shapes and dtypes of a host micro-batch's token tensors, its cu_seqlens as host integers)."""
    extra = set(batch) - _TEXT_KEYS
    if extra:
        raise ValueError(f"--cuda-graph captures text batches ({', '.join(sorted(_TEXT_KEYS))}); this one also has "
                         f"{sorted(extra)}: drop --cuda-graph for image batches")
    shapes = tuple((k, tuple(batch[k].shape), batch[k].dtype) for k in sorted(batch) if k != "cu_seqlens")
    return shapes, batch["cu_seqlens"].tolist()


def _pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


@dataclass(frozen=True)
class Capacity:
    """What one captured graph takes: ``shapes`` (``layout``'s), ``tokens`` the packed row's length and
    ``documents`` slots in its cu_seqlens (the last always empty). A document may be as long as the row: MLA's
    flash varlen call is sized for that (its spare blocks exit at once)."""

    shapes: tuple
    tokens: int
    documents: int

    @staticmethod
    def covering(shapes: tuple, cu: list[int], before: Capacity | None = None) -> Capacity:
        """The capacity for a batch, twice its documents (at least 16: room for later batches), that also covers
        ``before`` when the shapes are the same."""
        slots = max(16, _pow2(2 * len(cu)))
        if before is not None and before.shapes == shapes:
            slots = max(slots, before.documents)
        return Capacity(shapes, cu[-1], slots)

    def fits(self, shapes: tuple, cu: list[int]) -> bool:
        return shapes == self.shapes and len(cu) <= self.documents


def device_document_starts(cu: torch.Tensor, tokens: int) -> torch.Tensor:
    """From a padded cu_seqlens [S+1] on any device, in a fixed shape and without reading its values back: each
    position's document start [tokens] (QK-clip's kernel, the short conv's).

        start(t) = cu[d(t)],  d(t) = #{i : cu_i <= t} - 1       (an empty document's start equals the next one's)"""
    return cu[torch.searchsorted(cu, torch.arange(tokens, device=cu.device), right=True) - 1]


class _NoHostValues:
    """The host values of a graph's cu_seqlens: there are none (they change with every replay). A layer that plans
    from them has to get a device plan registered instead (``StepGraph``'s docstring)."""

    def __init__(self, where: str):
        self.where = where

    def _refuse(self, *_):
        raise RuntimeError(f"a layer planned from the host values of cu_seqlens under --cuda-graph ({self.where}); "
                           "under a graph they change with every replay: this plan needs a device form "
                           "(k3.train.graph._Buffers.register_plans)")

    __iter__ = __getitem__ = __len__ = _refuse


class _Buffers:
    """The graph's input buffers on the device: the tokens (and labels), the padded cu_seqlens and each position's
    document start."""

    def __init__(self, cap: Capacity, placed, device):
        T, S = cap.tokens, cap.documents
        self.cu = torch.zeros(S + 1, dtype=torch.long, device=device)
        self.starts = torch.zeros(T, dtype=torch.long, device=device)
        self.input_ids = placed.input_ids.clone()
        self.labels = self.input_ids if placed.labels is placed.input_ids else placed.labels.clone()
        self.placed = dataclasses.replace(placed, input_ids=self.input_ids, labels=self.labels, cu_seqlens=self.cu)

    def register_plans(self, cap: Capacity) -> None:
        """The plans a layer asks of this cu_seqlens (``cached_plan``), in their device form."""
        cu, dev = self.cu, self.cu.device
        varlen.register_plans(cu, _NoHostValues("no host values"), {
            ("longest",): (None, cap.tokens),  # MLA's flash varlen maximum (k3.layers.sequence.mla.attend_varlen)
            ("starts", dev): self.starts,  # QK-clip's max-logit kernel, the short conv's (varlen.document_starts)
        })

    def fill(self, cap: Capacity, batch: dict, cu: list[int]) -> None:
        """One micro-batch into the buffers: its tokens and its cu_seqlens padded with empty documents (pinned
        copies), then the document starts built from them on the device (no per-token work on the host)."""
        T, S = cap.tokens, cap.documents
        varlen.check_cu_seqlens(cu, T)
        padded = torch.tensor(cu + [T] * (S + 1 - len(cu)), dtype=torch.long)
        self.cu.copy_(padded.pin_memory() if self.cu.is_cuda else padded, non_blocking=True)
        self.starts.copy_(device_document_starts(self.cu, T))
        for src, dst in ((batch["input_ids"], self.input_ids), (batch.get("labels"), self.labels)):
            if src is not None:
                dst.copy_(src.pin_memory() if src.device.type == "cpu" and dst.is_cuda else src, non_blocking=True)


class StepGraph:
    """One micro-batch's forward and backward, captured on the first ``run`` (and again for a micro-batch beyond
    its ``Capacity``) and replayed by the others.

    ``plan``: the run's (one-process) ``ParallelPlan``; ``memory``: the run's ``ActivationManager``;
    ``micro_batches``: how many micro-batches a step accumulates (each backward is of loss / micro_batches)."""

    def __init__(self, model, plan, memory, mtp_weight: float, micro_batches: int, record: tuple[str, ...] = ()):
        why = graph_unsupported(plan.device, plan.world, memory.policy)
        if why is not None:
            raise ValueError(f"--cuda-graph: {why}")
        self.model, self.plan, self.memory = model, plan, memory
        self.mtp_weight, self.micro_batches, self.record = mtp_weight, micro_batches, record
        self.graph, self.capacity, self.captures = None, None, 0
        self.saved_activation_bytes = None  # what the (eager) warm-up forward left for its backward
        self._amp = torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=False)
        self._acc = None

    @property
    def params(self) -> list[torch.nn.Parameter]:
        return [p for p in self.model.parameters() if p.requires_grad]

    def run(self, batch: dict, index: int):
        """Micro-batch ``index`` (0-based) of a step -> its ``StepLoss`` (the graph's output memory: read it before
        the next replay), its gradient (summed with the step's earlier micro-batches') in the parameters' ``.grad``."""
        shapes, cu = layout(batch)
        if self.graph is None or not self.capacity.fits(shapes, cu):
            self._capture(batch, cu, Capacity.covering(shapes, cu, self.capacity))
        self.buffers.fill(self.capacity, batch, cu)
        self.graph.replay()
        self._accumulate(index)
        return self.out

    # -------------------------------------------------------------- capture

    def _forward_backward(self, measure: bool = False):
        with self._amp, self.memory.forward(measure=measure) as saved:
            out = self.plan.placed_loss(self.model, self.buffers.placed, self.mtp_weight, self.record)
        (out.loss / self.micro_batches).backward()
        return out, saved

    def _capture(self, batch: dict, cu: list[int], cap: Capacity) -> None:
        params = self.params
        if self.graph is None and any(p.grad is not None for p in params):
            raise RuntimeError("StepGraph captures with every .grad None (the step's gradients are then the graph's "
                               "own memory); zero the gradients with set_to_none=True before the first replayed step")
        self.graph = self.out = self.grads = self.buffers = None  # a recapture frees the old graph first
        for p in params:
            p.grad = None
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        self.buffers = _Buffers(cap, self.plan.place(batch), self.plan.device)
        self.buffers.fill(cap, batch, cu)
        self.buffers.register_plans(cap)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # the warm-up: autotuning, compilation, cuBLAS workspaces
            for measure in (True, False):  # the measuring hooks, then the captured code exactly (compiled regions
                _, saved = self._forward_backward(measure=measure)  # are guarded on the hooks: each compiles here)
                if measure:
                    self.saved_activation_bytes = saved.kept_bytes
                for p in params:
                    p.grad = None
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        torch.cuda.empty_cache()  # the warm-up's activations back to the device for the graph's own pool
        plans = varlen.plans_of(self.buffers.cu)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            out, _ = self._forward_backward()
        built = [p for p in varlen.plans_of(self.buffers.cu) if not any(p is q for q in plans)]
        if built:
            raise RuntimeError(f"{len(built)} cu_seqlens plan(s) were built during capture (a host copy a replay would "
                               "repeat from freed memory); every plan must be built by the warm-up")
        self.graph, self.capacity, self.captures = graph, cap, self.captures + 1
        self.out = out  # the graph's outputs (the StepLoss), rewritten by every replay
        self._plans = plans  # the device tensors the graph reads, alive as long as it is
        self.grads = [p.grad for p in params if p.grad is not None]

    # -------------------------------------------------------------- replay

    def _accumulate(self, index: int) -> None:
        """The graph's backward writes each micro-batch's gradient over the last; the step's sum is kept aside and
        added back after the last micro-batch, where the optimiser reads ``.grad``."""
        n = self.micro_batches
        if n == 1:
            return
        if index == 0:
            if self._acc is None:
                self._acc = [torch.empty_like(g) for g in self.grads]
            torch._foreach_copy_(self._acc, self.grads)
        elif index < n - 1:
            torch._foreach_add_(self._acc, self.grads)
        else:
            torch._foreach_add_(self.grads, self._acc)
