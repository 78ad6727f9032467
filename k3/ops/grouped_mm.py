"""Grouped matmul for routed experts: rows sorted by expert, one matmul per expert group.

Legend: M routed rows, E experts, I in features, O out features. w [E,O,I] (the official [out, in] per expert).
On CUDA in bf16 with aligned shapes this is one ``torch._grouped_mm`` call (as the op ``k3::grouped_mm``, forward and
backward); elsewhere a loop over experts (never over tokens).
"""

from __future__ import annotations

import torch

__all__ = ["grouped_mm", "grouped_mm_weight_grad", "fused_dtypes"]


def fused_dtypes() -> tuple[torch.dtype, ...]:
    """The dtypes whose grouped matmul is one fused call on CUDA (no host read of the per-expert counts)."""
    return (torch.bfloat16,) if hasattr(torch, "_grouped_mm") else ()


def _can_fuse(x: torch.Tensor, w: torch.Tensor) -> bool:
    return (x.is_cuda and x.dtype in fused_dtypes()
            and x.shape[-1] % 8 == 0 and w.shape[1] % 8 == 0)


def grouped_mm(x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """x [M,I] sorted by expert, counts [E] rows per expert (sum M) -> [M,O]."""
    if _can_fuse(x, w):
        offs = counts.cumsum(0).to(torch.int32)
        # fp32 master weights under bf16 autocast are cast here, as autocast does for nn.Linear
        return torch.ops.k3.grouped_mm(x, w.to(torch.bfloat16), offs)
    return _expert_loop(x, w, counts)


@torch.library.custom_op("k3::grouped_mm", mutates_args=())
def _grouped_mm_op(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """``torch._grouped_mm`` of row-major x [M,I] (rows of group e up to offs[e]) with each w[e]^T, w [E,O,I].

    An op of its own so that its operands reach the kernel row-major whatever layout a compiler picked for them:
    the grouped kernel needs every group's start 16-byte aligned along a dimension that is contiguous, so a
    column-major x (or, in the backward, gradient) with a group of rows not a multiple of 8 fails a device-side
    assertion. Row-major operands are aligned for any number of rows per group."""
    return torch._grouped_mm(x.contiguous(), w.transpose(-1, -2), offs=offs)


@_grouped_mm_op.register_fake
def _(x, w, offs):
    return x.new_empty(x.shape[0], w.shape[1])


def _grouped_mm_setup(ctx, inputs, output):
    x, w, offs = inputs
    ctx.save_for_backward(x, w, offs)


def _grouped_mm_backward(ctx, dy):
    """dx = dy w[e] per group (the op again, over w^T); dw[e] = dy_e^T x_e as one grouped product whose shared dim
    is the rows (dy^T column-major, x row-major: no alignment needed along the rows)."""
    x, w, offs = ctx.saved_tensors
    dy = dy.contiguous()
    dx = torch.ops.k3.grouped_mm(dy, w.transpose(1, 2), offs) if ctx.needs_input_grad[0] else None
    dw = torch._grouped_mm(dy.t(), x.contiguous(), offs=offs) if ctx.needs_input_grad[1] else None  # [E,O,I]
    return dx, dw, None


_grouped_mm_op.register_autograd(_grouped_mm_backward, setup_context=_grouped_mm_setup)


def grouped_mm_weight_grad(dy: torch.Tensor, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """The weight gradient of ``grouped_mm(x, w, counts)`` for its output gradient dy [M,O]: [E,O,I], expert e's
    dy_e^T x_e (zeros for an expert without rows)."""
    if _can_fuse(x, dy) and dy.dtype == x.dtype:
        # dy^T column-major and x row-major: no alignment needed along the rows (k3::grouped_mm's backward)
        return torch._grouped_mm(dy.contiguous().t(), x.contiguous(), offs=counts.cumsum(0).to(torch.int32))
    return _expert_loop_weight_grad(dy, x, counts)


@torch.compiler.disable  # reads the counts on the host, as _expert_loop
def _expert_loop_weight_grad(dy: torch.Tensor, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    out = dy.new_zeros(counts.numel(), dy.shape[1], x.shape[1])
    for e, (dye, xe) in enumerate(zip(dy.split(counts.tolist()), x.split(counts.tolist()))):
        if xe.shape[0]:
            out[e] = dye.T @ xe
    return out


@torch.compiler.disable  # reads the counts on the host: under torch.compile a clean break, never a recompile per load
def _expert_loop(x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    # unbind, not w[e]: w[e]'s backward writes a zero-filled [E,O,I] gradient per expert (7x the loop's time with
    # 32 experts on CPU); unbind's writes one
    ws = w.unbind(0)
    outs = [xe @ ws[e].T for e, xe in enumerate(x.split(counts.tolist())) if xe.shape[0]]
    return torch.cat(outs) if outs else x.new_zeros(0, w.shape[1])
