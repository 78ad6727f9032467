"""The router for a few tokens (decode), fused (SPEC §4): the same math as ``Router.forward``
(k3.ops.routing's ``router_scores`` + ``select_experts``, the reference) in one Triton kernel.

Legend: N tokens, D hidden, E experts, k experts per token.

    s = sigmoid(x W^T)  (fp32),   chosen = top-k of s + bias,   w_j = scaling * s_chosen_j / sum_j s_chosen_j

The reference's path at one token is ~8 kernels per MoE layer (an fp32 GEMV as cuBLAS dot + reduce, the sigmoid
and bias, the top-k's radix passes, the gather, the renormalisation); here one kernel computes the scores (several
programs per token, each a block of 4 experts) and the last of a token's programs to finish selects its top k
(``k3.ops._arrivals``: a counter per token, no second launch). Indices come in descending order
of the biased score (the reference's are unordered: ``topk(sorted=False)``); a tie goes to the lower index.
No gradient: inference only.
"""

from __future__ import annotations

import torch

from ._triton import triton_available
from .moe_decode import DECODE_ROWS

__all__ = ["router_decode", "router_decode_applies"]


def router_decode_applies(x: torch.Tensor, k: int, score_func: str) -> bool:
    """The fused path runs: CUDA, no gradient, sigmoid scores, at most DECODE_ROWS routed rows (the rows for which
    the fused expert kernels run too), Triton importable."""
    return (x.is_cuda and not torch.is_grad_enabled() and score_func == "sigmoid" and x.shape[0] * k <= DECODE_ROWS
            and triton_available())


def router_decode(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, k: int, renormalize: bool,
                  scaling: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [N,D], weight [E,D], bias [E] (any float dtype) -> (weights [N,k] fp32, indices [N,k] int64, scores [N,E]
    fp32). A custom op: torch.compile calls it as one opaque kernel. Also runs under TRITON_INTERPRET=1 on CPU."""
    if not 1 <= k <= weight.shape[0]:
        raise ValueError(f"num_experts_per_token must be in [1, num_experts={weight.shape[0]}], got {k}")
    return torch.ops.k3.router_decode(x, weight, bias, k, renormalize, float(scaling))


@torch.library.custom_op("k3::router_decode", mutates_args=())
def _router_decode(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, k: int, renormalize: bool,
                   scaling: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    from ._router_decode_triton import router_decode_kernels

    # the bias in its own dtype (a bf16 model's: cast by .to with the rest), widened in the kernel: no copy per step
    return router_decode_kernels(x.contiguous(), weight.contiguous(), bias.contiguous(), k, renormalize, scaling)


@_router_decode.register_fake
def _(x, weight, bias, k, renormalize, scaling):
    N, E = x.shape[0], weight.shape[0]
    return (x.new_empty(N, k, dtype=torch.float32), x.new_empty(N, k, dtype=torch.int64),
            x.new_empty(N, E, dtype=torch.float32))
