"""Muon with per-head and per-expert orthogonalisation (SPEC §5).

Legend: A, B the two dims of the matrix actually orthogonalised (a head block, an expert, or the whole
weight); N the batch of such blocks (heads H or experts E, 1 for a whole matrix).

    buf <- lerp(buf, g, 1 - mu)                      momentum 0.95, EMA form (as torch.optim.Muon)
    u   <- lerp(g, buf, mu)                          Nesterov
    O   <- NewtonSchulz5(u) per block                 [N,A,B], singular values pushed into ~[0.7, 1.2]
    p   <- p * (1 - lr * wd)                          decoupled weight decay
    p   <- p - lr * 0.2 * sqrt(max(A, B)) * O         RMS of the step ~ 0.2 * lr, like AdamW's

Each param group carries a ``split`` saying which blocks to orthogonalise:
- ``"whole"``   a 2-D weight [out, in] as one matrix;
- ``"rows:H"``  a 2-D weight whose output rows are grouped by head: H blocks [out/H, in];
- ``"cols:H"``  a 2-D weight whose input columns are grouped by head (output projections): H blocks [out, in/H];
- ``"experts"`` a 3-D routed-expert bank [E, out, in]: E blocks, one per expert.
A 3-D tensor with any other split is rejected: it would otherwise be flattened or sent to AdamW silently.
"""

from __future__ import annotations

import math

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.experimental import implicit_replication
from torch.optim import Optimizer

from ...ops.muon_step import apply_update, momentum_into, normalized_blocks, ns_polynomial

NS_COEFFS = (3.4445, -4.7750, 2.0315)
SPLIT_HELP = 'expected "whole", "rows:H", "cols:H" (H a positive int dividing that dim) or "experts"'


def newton_schulz(G: torch.Tensor, steps: int = 5, coeffs: tuple[float, float, float] = NS_COEFFS,
                  eps: float = 1e-7) -> torch.Tensor:
    """Approximate U V^T of each matrix G [..., A, B] = U S V^T with a quintic Newton-Schulz iteration.

    Batched over leading dims; each matrix is normalised by its own Frobenius norm (so its spectral norm is
    <= 1). Runs in bf16 on GPU (as in Keller Jordan's Muon) and fp32 on CPU; returns G's dtype. The iteration
    is tuned for speed, not convergence: singular values land in roughly [0.7, 1.2], not exactly at 1, and
    directions whose singular value is below ~1e-3 of the Frobenius norm are not fully raised in 5 steps.
    """
    if G.dim() < 2:
        raise ValueError(f"newton_schulz needs a matrix or a batch of matrices [..., A, B], got shape {tuple(G.shape)}")
    a, b, c = coeffs
    X = normalized_blocks(G.reshape(-1, *G.shape[-2:]), eps, torch.bfloat16 if G.is_cuda else torch.float32)
    tall = G.size(-2) > G.size(-1)
    if tall:  # iterate on the wide orientation: the Gram matrix X X^T is then min(A, B) square
        X = X.mT
    for _ in range(steps):
        gram = X @ X.mT
        poly = ns_polynomial(gram, a, b)  # a I + b G, one pass
        poly.baddbmm_(gram, gram, alpha=c)  # + c G^2, in place: no copy of G for the GEMM's C
        X = poly @ X  # a X + (b G + c G^2) X; as one product no copy of X either (baddbmm(X, ...) copies X first)
    if tall:
        X = X.mT
    return X.to(G.dtype).reshape(G.shape)


def parse_split(split: str, shape: torch.Size, name: str = "parameter") -> tuple[str, int]:
    """Check that ``split`` fits a tensor of ``shape``; return (kind, H) with H = 1 unless per-head."""
    kind, _, heads = str(split).partition(":")
    ndim = len(shape)
    if kind == "experts":
        if ndim != 3:
            raise ValueError(f'{name}: split "experts" needs a 3-D [E, out, in] tensor, got shape {tuple(shape)}')
        return kind, shape[0]
    if ndim == 3:
        raise ValueError(f'{name}: 3-D tensor {tuple(shape)} with split "{split}"; Muon orthogonalises 3-D '
                         'tensors only as routed experts (split "experts")')
    if ndim != 2:
        raise ValueError(f"{name}: Muon optimises matrices; shape {tuple(shape)} belongs in AdamW")
    if kind == "whole" and not heads:
        return kind, 1
    if kind in ("rows", "cols") and heads.isdigit() and int(heads) > 0:
        H, dim = int(heads), shape[0] if kind == "rows" else shape[1]
        if dim % H:
            raise ValueError(f'{name}: split "{split}" needs {kind} ({dim}) divisible by {H}, shape {tuple(shape)}')
        return kind, H
    raise ValueError(f'{name}: unknown split "{split}"; {SPLIT_HELP}')


def to_blocks(t: torch.Tensor, kind: str, H: int) -> torch.Tensor:
    """The matrices to orthogonalise, [N, A, B]."""
    if kind == "experts":
        return t
    if kind == "rows":
        return t.reshape(H, t.shape[0] // H, t.shape[1])
    if kind == "cols":
        return t.reshape(t.shape[0], H, t.shape[1] // H).transpose(0, 1)
    return t[None]


def from_blocks(O: torch.Tensor, kind: str, shape: torch.Size) -> torch.Tensor:
    """Inverse of ``to_blocks``: [N, A, B] back to the parameter's shape."""
    if kind == "cols":
        return O.transpose(0, 1).reshape(shape)
    return O.reshape(shape)


def block_shape(shape: torch.Size, kind: str, H: int) -> tuple[int, int]:
    """(A, B) of one orthogonalised block."""
    if kind == "experts":
        return shape[1], shape[2]
    if kind == "rows":
        return shape[0] // H, shape[1]
    return (shape[0], shape[1] // H) if kind == "cols" else (shape[0], shape[1])


class Muon(Optimizer):
    """Muon for hidden matrices (SPEC §5); one ``split`` per param group (see the module docstring).

    ``lr`` is the AdamW-equivalent learning rate: the step's RMS is ~0.2 * lr whatever the block shape.
    Blocks of one shape, across parameters and groups, go through Newton-Schulz in one batched call (few
    large matmuls instead of many small ones), at most ``bucket_numel`` elements per call to bound memory.
    """

    def __init__(self, params, lr: float = 2e-4, momentum: float = 0.95, nesterov: bool = True,
                 weight_decay: float = 0.1, split: str = "whole", ns_steps: int = 5, eps: float = 1e-7,
                 bucket_numel: int = 2**26):
        if lr < 0 or weight_decay < 0 or not 0 <= momentum < 1:
            raise ValueError(f"Muon: need lr >= 0, weight_decay >= 0 and 0 <= momentum < 1; "
                             f"got lr={lr}, weight_decay={weight_decay}, momentum={momentum}")
        defaults = dict(lr=lr, momentum=momentum, nesterov=nesterov, weight_decay=weight_decay, split=split,
                        ns_steps=ns_steps, eps=eps)
        self.bucket_numel = bucket_numel
        self._plan: tuple = (None, [])  # (key, buckets) of ``_buckets``
        super().__init__(params, defaults)

    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        for i, p in enumerate(group["params"]):  # fail at construction, not at the first step
            parse_split(group["split"], p.shape, f"Muon param group {len(self.param_groups) - 1} param {i}")

    @torch.no_grad()
    def step(self, closure=None, scale: torch.Tensor | None = None):
        """One update; ``scale``: a 0-d tensor every gradient is multiplied by first (gradient clipping's
        coefficient, ``clip_coefficient``), read in the momentum pass: the gradients are not written."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for bucket in self._buckets():
            self._update(bucket, scale)
        return loss

    def _buckets(self) -> list["_Bucket"]:
        """This step's buckets: blocks of one (wide) shape, NS settings, device and dtype, at most ``bucket_numel``
        elements each. Built once and kept while the parameters with a gradient, their storage, their splits and
        NS settings stay the same (the per-step host work is then one key and, per tensor, one ``as_strided``: a
        small model's optimiser step is bound by the host)."""
        live = [(p, group) for group in self.param_groups for p in group["params"] if p.grad is not None]
        if any(p.grad.is_sparse for p, _ in live):
            raise RuntimeError("Muon does not support sparse gradients")
        key = tuple((id(p), None if isinstance(p, DTensor) else p.data_ptr(), p.grad.dtype, group["split"],
                     group["ns_steps"], group["eps"], id(group)) for p, group in live)
        if self._plan[0] == key:
            return self._plan[1]
        by_shape: dict[tuple, list] = {}
        for p, group in live:
            kind, H = parse_split(group["split"], p.shape)
            A, B = block_shape(p.shape, kind, H)
            by_shape.setdefault((min(A, B), max(A, B), group["ns_steps"], group["eps"], p.device, p.grad.dtype),
                                []).append((p, group, kind, H))
        buckets = []
        for (_, n_max, steps, eps, _, _), items in by_shape.items():
            chunk, size = [], 0
            for item in items:
                chunk.append(item)
                size += item[0].numel()
                if size >= self.bucket_numel:
                    buckets.append(_Bucket(chunk, steps, eps, n_max))
                    chunk, size = [], 0
            if chunk:
                buckets.append(_Bucket(chunk, steps, eps, n_max))
        self._plan = (key, buckets)
        return buckets

    def _update(self, bucket: "_Bucket", scale: torch.Tensor | None = None) -> None:
        """One bucket: blocks of one (wide) shape from any number of parameters, through Newton-Schulz as ONE
        batched bmm chain. Each parameter's blocks are a strided view of its storage (``_blocks``), through which
        its slot in the batch (bf16 on CUDA) is filled and its update added back: the momentum and Nesterov mix into
        the batch, then decay and update into the weights, each one pass over the bucket (``k3.ops.muon_step``: one
        Triton launch per memory order on CUDA, torch ops elsewhere). FSDP2 shards (DTensors) update their momentum
        shard by shard and orthogonalise the gathered whole matrix."""
        items, plain, sizes = bucket.items, bucket.plain, bucket.sizes
        for p, _, _, _ in items:  # each momentum buffer in its parameter's layout (one view of both, and of the grad)
            state = self.state[p]
            buf = state.get("momentum_buffer")
            if buf is None:
                state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            elif not isinstance(p, DTensor) and buf.stride() != p.stride():  # e.g. loaded from another layout
                state["momentum_buffer"] = _in_layout(buf, p)
        X = torch.empty(sum(sizes), bucket.R, bucket.C, device=bucket.device,
                        dtype=torch.bfloat16 if bucket.device.type == "cuda" else torch.float32)
        slots = X.split(sizes)
        momentum_into([bucket.view(i, items[i][0].grad) for i in plain],
                      [bucket.view(i, self.state[items[i][0]]["momentum_buffer"]) for i in plain],
                      [slots[i] for i in plain], [items[i][1]["momentum"] for i in plain],
                      [items[i][1]["nesterov"] for i in plain], scale)
        for (p, group, kind, H), slot in zip(items, slots):
            if isinstance(p, DTensor):
                buf, mu, g = self.state[p]["momentum_buffer"], group["momentum"], p.grad
                if scale is not None:
                    with implicit_replication():  # the plain 0-d scale as a replicated factor
                        g = g * scale
                buf.lerp_(g, 1 - mu)
                u = torch.lerp(g, buf, mu) if group["nesterov"] else buf
                slot.copy_(_blocks(u.full_tensor(), kind, H))
        O = newton_schulz(X, bucket.steps, eps=bucket.eps).split(sizes)
        scale = 0.2 * math.sqrt(bucket.n_max)
        decays = [1 - g["lr"] * g["weight_decay"] for _, g, _, _ in items]
        alphas = [-g["lr"] * scale for _, g, _, _ in items]
        apply_update([bucket.param_views[i] for i in plain], [O[i] for i in plain],
                     [decays[i] for i in plain], [alphas[i] for i in plain])
        for (p, group, kind, H), slot, decay, alpha in zip(items, O, decays, alphas):
            if isinstance(p, DTensor):
                A, B = block_shape(p.shape, kind, H)
                full = from_blocks(slot.mT if A > B else slot, kind, p.shape).to(p.dtype)
                p.mul_(decay).add_(_like(p, full), alpha=alpha)


class _Bucket:
    """One Newton-Schulz batch: its items (param, group, kind, H), NS settings, each plain parameter's block view
    (``_blocks``) and, to view a gradient or momentum buffer of the parameter's layout the same way, that view's
    shape, strides and offset within the parameter."""

    def __init__(self, items: list, steps: int, eps: float, n_max: int):
        self.items, self.steps, self.eps, self.n_max = items, steps, eps, n_max
        views = [_blocks(p, kind, H) for p, _, kind, H in items]
        self.sizes = [v.shape[0] for v in views]
        self.R, self.C = views[0].shape[1:]
        self.device = items[0][0].device
        self.plain = [i for i, (p, _, _, _) in enumerate(items) if not isinstance(p, DTensor)]
        self.param_views = {i: views[i] for i in self.plain}
        self.geometry = {i: (views[i].shape, views[i].stride(), views[i].storage_offset() - p.storage_offset(),
                             p.stride()) for i, p in ((i, items[i][0]) for i in self.plain)}

    def view(self, i: int, t: torch.Tensor) -> torch.Tensor:
        """Item i's blocks of ``t`` (its gradient or momentum buffer) through one ``as_strided``; a gradient in
        another layout than the parameter's (autograd's usual one) is first copied into that layout."""
        shape, stride, offset, layout = self.geometry[i]
        if t.stride() != layout:
            t = _in_layout(t, self.items[i][0])
        return t.as_strided(shape, stride, t.storage_offset() + offset)


def _in_layout(t: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """A copy of ``t`` with ``p``'s strides."""
    return torch.empty_strided(p.shape, p.stride(), dtype=t.dtype, device=t.device).copy_(t)


def _blocks(t: torch.Tensor, kind: str, H: int) -> torch.Tensor:
    """The blocks to orthogonalise as a strided view [N, R, C] of ``t``'s storage, in the wide orientation
    (R <= C; NS(X^T) = NS(X)^T, so a bucket's blocks share one orientation). Of a DTensor, a view of its global
    shape on the meta device (the layout only: its data is gathered where needed)."""
    v = to_blocks(torch.empty(t.shape, device="meta") if isinstance(t, DTensor) else t, kind, H)
    return v.mT if v.shape[-2] > v.shape[-1] else v


def _like(p: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
    """``full`` laid out like ``p``: as is, or (FSDP2 shards) this rank's piece of it as a DTensor. Every rank
    orthogonalised the same whole matrix, so each just takes its own rows."""
    if not isinstance(p, DTensor):
        return full
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
    local = full[tuple(slice(o, o + n) for o, n in zip(offset, shape))]
    return DTensor.from_local(local.contiguous(), p.device_mesh, p.placements, shape=p.shape, stride=p.stride())
