"""The training step's forward and backward as one CUDA graph (``k3 train --cuda-graph``): captured once for a
micro-batch layout, then replayed, so the host issues one launch per micro-batch instead of the ~6,000 kernels
(fla's launchers, the compiled regions' guards, autograd's nodes) that bound a small model's step.

What is recorded: ``plan.placed_loss`` of a placed micro-batch under autocast, and its backward (the activation
memory policy's hooks included). What stays eager: the copy of each batch's tokens into the graph's input buffers,
gradient accumulation over micro-batches, clipping, the optimiser and the schedule (the learning rate is a Python
number the optimiser reads each step), Quantile Balancing and QK-clip.

The rules a replay depends on, checked here rather than assumed:
  - the layout: every replayed micro-batch has the captured one's token shape and document boundaries (the layers
    plan their kernels from cu_seqlens' host values, and fla's chunk lists, MLA's varlen call and the short conv's
    tiles are sized by them); another layout is refused with what to change;
  - the gradients: captured with ``.grad`` None, the backward writes fresh gradients into the graph's memory on
    every replay (so they are never zeroed or set to None afterwards: the optimiser reads them there);
  - device work only: one process (no collectives), no offload policy (host copies), the default loss (a caller's
    own loss function may read the device), text batches;
  - what the forward leaves on modules for later eager code (QK-clip's ``max_logit``, the router's
    ``last_routing`` for balancing) is the graph's output memory: after each replay the modules get it back, the
    max logit as the running maximum over the step's micro-batches as an eager forward would leave it;
  - the plans the layers built from cu_seqlens (``k3.ops.varlen.cached_plan``) are device tensors the graph reads:
    they are held here for the graph's lifetime, and capture fails if any had to be built (copied from the host)
    during it.

One extra forward and backward runs once, eagerly on the capture stream before capturing (as PyTorch's whole-
network capture does: lazy initialisation and autotuning outside the graph); its gradients are discarded. Memory:
the graph keeps its activations' pool between steps, so the optimiser's temporaries come on top of the
activation peak instead of reusing it.
"""

from __future__ import annotations

import torch

from ..ops import varlen

__all__ = ["StepGraph", "graph_unsupported"]

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


def layout(batch: dict) -> tuple:
    """What a graph's replay depends on in a host micro-batch: its tensors' shapes and dtypes and its document
    boundaries."""
    extra = set(batch) - _TEXT_KEYS
    if extra:
        raise ValueError(f"--cuda-graph captures text batches ({', '.join(sorted(_TEXT_KEYS))}); this one also has "
                         f"{sorted(extra)}: drop --cuda-graph for image batches")
    shapes = tuple((k, tuple(batch[k].shape), batch[k].dtype) for k in sorted(batch))
    return shapes, tuple(batch["cu_seqlens"].tolist())


class StepGraph:
    """One micro-batch's forward and backward, captured on the first ``run`` and replayed by the later ones.

    ``plan``: the run's (one-process) ``ParallelPlan``; ``memory``: the run's ``ActivationManager``;
    ``micro_batches``: how many micro-batches a step accumulates (each backward is of loss / micro_batches)."""

    def __init__(self, model, plan, memory, mtp_weight: float, micro_batches: int):
        why = graph_unsupported(plan.device, plan.world, memory.policy)
        if why is not None:
            raise ValueError(f"--cuda-graph: {why}")
        self.model, self.plan, self.memory = model, plan, memory
        self.mtp_weight, self.micro_batches = mtp_weight, micro_batches
        self.graph = None
        self.captured_layout = None
        self.saved_activation_bytes = None  # what the (eager) warm-up forward left for its backward
        self._amp = torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=False)

    @property
    def params(self) -> list[torch.nn.Parameter]:
        return [p for p in self.model.parameters() if p.requires_grad]

    def run(self, batch: dict, index: int) -> tuple[torch.Tensor, torch.Tensor | None, int]:
        """Micro-batch ``index`` (0-based) of a step -> (its lm loss, MTP loss or None, tokens), its gradient (summed
        with the step's earlier micro-batches') in the parameters' ``.grad``. Captures on the first call."""
        key = layout(batch)
        if self.graph is None:
            self._capture(batch, key)
        elif key != self.captured_layout:
            raise ValueError(self._layout_error(key))
        self._copy_inputs(batch)
        self.graph.replay()
        self._restore_side_outputs()
        self._accumulate(index)
        return self.out

    # -------------------------------------------------------------- capture

    def _forward_backward(self, placed, measure: bool = False):
        with self._amp, self.memory.forward(measure=measure) as saved:
            out = self.plan.placed_loss(self.model, placed, self.mtp_weight)
        (out.loss / self.micro_batches).backward()
        return out, saved

    def _capture(self, batch: dict, key: tuple) -> None:
        params = self.params
        if any(p.grad is not None for p in params):
            raise RuntimeError("StepGraph captures with every .grad None (the step's gradients are then the graph's "
                               "own memory); zero the gradients with set_to_none=True before the first replayed step")
        self.static = self.plan.place(batch)
        cu = self.static.cu_seqlens
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # the warm-up: autotuning, compilation, cuBLAS workspaces, the plans
            _, saved = self._forward_backward(self.static, measure=True)
        torch.cuda.current_stream().wait_stream(stream)
        self.saved_activation_bytes = saved.kept_bytes
        for p in params:
            p.grad = None
        self._clear_side_outputs()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()  # the warm-up's activations back to the device for the graph's own pool
        plans = varlen.plans_of(cu)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            out, _ = self._forward_backward(self.static)
        built = [p for p in varlen.plans_of(cu) if not any(p is q for q in plans)]
        if built:
            raise RuntimeError(f"{len(built)} cu_seqlens plan(s) were built during capture (a host copy a replay would "
                               "repeat from freed memory); every plan must be built by the warm-up")
        self.graph, self.captured_layout = graph, key
        self.out = (out.lm_loss, out.mtp_loss, out.tokens)  # the graph's outputs, rewritten by every replay
        self._plans = plans  # the device tensors the graph reads, alive as long as it is
        self.grads = [p.grad for p in params if p.grad is not None]
        self._side = self._side_outputs()
        self._clear_side_outputs()
        self._acc = None

    def _layout_error(self, key: tuple) -> str:
        (shapes, cu), (shapes0, cu0) = key, self.captured_layout
        what = f"shapes {shapes} against {shapes0}" if shapes != shapes0 else \
            f"{len(cu) - 1} documents {list(cu[:6])}{'...' if len(cu) > 6 else ''} against {len(cu0) - 1} " \
            f"{list(cu0[:6])}{'...' if len(cu0) > 6 else ''}"
        return ("--cuda-graph replays the micro-batch layout it captured (token shape and document boundaries); this "
                f"micro-batch's differs: {what}. Give every micro-batch the same layout (e.g. fixed-length documents) "
                "or drop --cuda-graph")

    # -------------------------------------------------------------- replay

    def _copy_inputs(self, batch: dict) -> None:
        """The micro-batch's tokens (and labels) into the graph's input buffers: pinned, non-blocking copies (its
        boundaries are the captured ones: ``layout`` checked them)."""
        s = self.static
        for src, dst in ((batch["input_ids"], s.input_ids), (batch.get("labels"), s.labels)):
            if src is not None:
                dst.copy_(src.pin_memory() if src.device.type == "cpu" else src, non_blocking=True)

    def _side_outputs(self) -> list[tuple]:
        from ..layers.sequence.mla import GatedMLA
        from ..layers.width.latent_moe import LatentMoE

        side = []
        for m in self.model.modules():
            if isinstance(m, GatedMLA) and m.max_logit is not None:
                side.append((m, "max_logit", m.max_logit))
            elif isinstance(m, LatentMoE) and getattr(m, "last_routing", None) is not None:
                side.append((m, "last_routing", m.last_routing))
        return side

    def _clear_side_outputs(self) -> None:
        for m, name, _ in self._side_outputs():
            setattr(m, name, None)

    def _restore_side_outputs(self) -> None:
        """As an eager forward leaves them: the running max logit over the step's micro-batches (a copy: the next
        replay overwrites the graph's), the routing of the last micro-batch (read by the balancer before the next
        replay, in stream order)."""
        for m, name, value in self._side:
            if name == "max_logit":
                m.max_logit = value.clone() if m.max_logit is None else torch.maximum(m.max_logit, value)
            else:
                setattr(m, name, value)

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

