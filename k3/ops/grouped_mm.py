"""Grouped matmul for routed experts: rows sorted by expert, one matmul per expert group.

Legend: M routed rows, E experts, I in features, O out features. w [E,O,I] (the official [out, in] per expert).
On CUDA in bf16 with aligned shapes this is one ``torch._grouped_mm`` call (as the op ``k3::grouped_mm``, forward and
backward); elsewhere a loop over experts (never over tokens).
"""

from __future__ import annotations

import torch

__all__ = ["grouped_mm", "fused_dtypes"]


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

    Ops of their own (this and ``k3::grouped_mm_weight_grad``, its backward's weight gradient) so that the operands
    reach the kernel in the layout each product needs, whatever a compiler does with views around them: the grouped
    kernel needs each group's start 16-byte aligned wherever the rows are the contiguous dimension of an operand.
    Row-major x (forward) and a column-major dy^T (the weight gradient, dy^T x with the rows as the shared dim) are
    aligned for any number of rows per group; inductor, left to lay out ``_grouped_mm(dy.t(), x)`` itself, made
    dy^T row-major and the kernel's device-side assertion failed on expert loads that are not multiples of 8."""
    return torch._grouped_mm(x.contiguous(), w.transpose(-1, -2), offs=offs)


@_grouped_mm_op.register_fake
def _(x, w, offs):
    return x.new_empty(x.shape[0], w.shape[1])


@torch.library.custom_op("k3::grouped_mm_weight_grad", mutates_args=())
def _grouped_mm_weight_grad(dy: torch.Tensor, x: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """[E,O,I]: group e's dy_e^T x_e for dy [M,O] and x [M,I] in row groups up to offs[e] (dy^T column-major, x
    row-major: the rows, the product's shared dimension, need no alignment)."""
    return torch._grouped_mm(dy.contiguous().t(), x.contiguous(), offs=offs)


@_grouped_mm_weight_grad.register_fake
def _(dy, x, offs):
    return dy.new_empty(offs.shape[0], dy.shape[1], x.shape[1])


def _grouped_mm_setup(ctx, inputs, output):
    x, w, offs = inputs
    ctx.save_for_backward(x, w, offs)


def _grouped_mm_backward(ctx, dy):
    """dx = dy w[e] per group (the op again, over w^T); dw[e] = dy_e^T x_e (``k3::grouped_mm_weight_grad``)."""
    x, w, offs = ctx.saved_tensors
    dx = torch.ops.k3.grouped_mm(dy, w.transpose(1, 2), offs) if ctx.needs_input_grad[0] else None
    dw = torch.ops.k3.grouped_mm_weight_grad(dy, x, offs) if ctx.needs_input_grad[1] else None
    return dx, dw, None


_grouped_mm_op.register_autograd(_grouped_mm_backward, setup_context=_grouped_mm_setup)


@torch.compiler.disable  # reads the counts on the host: under torch.compile a clean break, never a recompile per load
def _expert_loop(x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    # unbind, not w[e]: w[e]'s backward writes a zero-filled [E,O,I] gradient per expert (7x the loop's time with
    # 32 experts on CPU); unbind's writes one
    ws = w.unbind(0)
    outs = [xe @ ws[e].T for e, xe in enumerate(x.split(counts.tolist())) if xe.shape[0]]
    return torch.cat(outs) if outs else x.new_zeros(0, w.shape[1])
