"""One KDA decode token per row, on states that stay where they live (SPEC §2.1, §7).

Legend: B rows, H heads, K = V head dim, W conv width, P pages (state slots). ``state`` [P,H,K,V] fp32 and
``conv`` [P,3,H*K,W-1] are strided views of the engine's page pool; row b's state is slot ``index[b]``.
Per row, from the pre-conv projections q, k, v [H*K] each, the raw gate input f [H,K] (or its low-rank input f_a
[RF] and f_b [H*K,RF], f = f_b f_a) and the raw beta logit b [H]:

    y = SiLU(conv(tail ++ x)),  tail <- last W-1 inputs        (the short convs, q/k/v)
    q, k = L2Norm(y_q), L2Norm(y_k) per head;  v = y_v;  g = gate(f);  beta = sigmoid(b)
    S <- (I - beta k k^T) Diag(e^g) S + beta k v^T;  o = S^T q * scale        (the recurrence, one step)

and both the tail and S are written back into the same slot.

- ``kda_decode_reference``: gathers the slots, runs ``reference.recurrent_kda``, scatters back (CPU; oracle).
- ``kda_decode_fused``: all of it in ONE Triton kernel (``_decode_triton._kda_decode_kernel``), one program per
  (row, head, block of 32 V columns): q, k, v, f_a and b read in place from their strided slices of the fused
  projection, the gate's second projection (up to 8 rows), convs, norms, gate, beta and the state step in
  registers, tails and state written back in place. Needs Triton only (not fla-core). Against fla-core's fused
  recurrence behind our own conv kernel (four launches: a stack of q/k/v, the convs, a copy of b, the
  recurrence), the one kernel took 5.9 / 7.1 / 13.8 / 18.8 us per layer at 1 / 8 / 32 / 64 rows against 9.2 /
  12.7 / 18.8 / 26.1 (``benchmarks/RESULTS.md``), so that path is gone.

``kda_decode`` picks: the reference when the KDA backend resolves to "torch" by request (``backend="torch"`` or
``K3_KDA_BACKEND=torch``: the exact path the distributed tests compare against) or the tensors are not on CUDA
in a kernel dtype (bf16, fp16, fp32) or Triton does not import; otherwise the fused kernel. It does not depend
on fla-core, so "auto" takes it on CUDA even where fla-core does not import (where ``resolve_backend`` says
"torch" only because prefill's chunked kernel is missing).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..norms import l2_norm
from . import reference
from .._triton import triton_available
from .fla import FLA_DTYPES
from .gate import kda_gate

__all__ = ["kda_decode", "kda_decode_reference", "kda_decode_fused", "conv_decode_reference"]


def conv_decode_reference(x3: torch.Tensor, weights, conv: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """x3 [B,3,HK] new inputs; weights (w_q, w_k, w_v) each [HK,1,W]; conv [P,3,HK,W-1] tails (updated in place
    at ``index``). Returns SiLU(conv) [B,3,HK] fp32."""
    w = torch.stack([wt.view(wt.shape[0], -1) for wt in weights]).float()  # [3,HK,W]
    tails = conv[index].float()  # [B,3,HK,W-1]
    window = torch.cat([tails, x3.float()[..., None]], dim=-1)  # [B,3,HK,W], oldest first
    conv.index_copy_(0, index, window[..., 1:].to(conv.dtype))
    return F.silu((window * w).sum(-1))


def kda_decode_reference(q, k, v, f, b, conv_weights, A_log, dt_bias, state, conv, index,
                         gate_kind: str = "lower_bound", lower_bound: float = -5.0,
                         scale: float | None = None, f_b_weight: torch.Tensor | None = None) -> torch.Tensor:
    """See the module docstring: q, k, v [B,H*K] pre-conv, f [B,H,K] (or, with ``f_b_weight`` [H*K,RF], the
    gate's low-rank input f_a [B,RF], and f = f_b(f_a)), b [B,H] (any strides); returns o [B,H,V] in q's dtype.
    ``index`` [B] long."""
    B, H = b.shape
    K = q.shape[-1] // H
    if f_b_weight is not None:
        f = F.linear(f, f_b_weight).view(B, H, K)
    y = conv_decode_reference(torch.stack([q, k, v], dim=1), conv_weights, conv, index)  # [B,3,HK] fp32
    qn, kn = l2_norm(y[:, 0].view(B, 1, H, K)), l2_norm(y[:, 1].view(B, 1, H, K))
    vy = y[:, 2].view(B, 1, H, K)
    g = kda_gate(f[:, None], A_log, dt_bias, gate_kind, lower_bound)
    beta = torch.sigmoid(b.float())[:, None]
    o, s = reference.recurrent_kda(qn, kn, vy, g, beta, scale, initial_state=state[index], output_final_state=True)
    state.index_copy_(0, index, s)
    return o[:, 0].to(q.dtype)


def _wants_reference(backend: str, x: torch.Tensor) -> bool:
    """True when the decode must run the pure-torch reference (see the module docstring)."""
    from . import requested_backend

    return requested_backend(backend) == "torch" or not x.is_cuda or x.dtype not in FLA_DTYPES


def kda_decode(q, k, v, f, b, conv_weights, A_log, dt_bias, state, conv, index, gate_kind: str = "lower_bound",
               lower_bound: float = -5.0, scale: float | None = None, backend: str = "auto",
               f_b_weight: torch.Tensor | None = None) -> torch.Tensor:
    """One decode step, in place; same arguments as ``kda_decode_reference``. Which kernel runs: see the module
    docstring (the fused kernel on CUDA, the reference elsewhere or with backend "torch")."""
    args = (q, k, v, f, b, conv_weights, A_log, dt_bias, state, conv, index, gate_kind, lower_bound, scale)
    if _wants_reference(backend, q) or not triton_available():
        return kda_decode_reference(*args, f_b_weight=f_b_weight)
    return kda_decode_fused(*args, f_b_weight=f_b_weight)


def kda_decode_fused(q, k, v, f, b, conv_weights, A_log, dt_bias, state, conv, index, gate_kind: str = "lower_bound",
                     lower_bound: float = -5.0, scale: float | None = None, block_v: int | None = None,
                     num_warps: int | None = None, f_b_weight: torch.Tensor | None = None) -> torch.Tensor:
    """The whole decode step as one Triton kernel launch (arguments as ``kda_decode_reference``; the tensors are
    read through their strides, nothing is copied; with ``f_b_weight`` and at most ``FUSE_GATE_ROWS`` rows the
    gate's second projection runs inside the kernel too). ``block_v``, ``num_warps``: the kernel's V tile and
    warps (defaults in ``_decode_triton.kda_decode_launch``). Returns o [B,H,V] in q's dtype."""
    from ._decode_triton import kda_decode_launch

    return kda_decode_launch(q, k, v, f, b, conv_weights, A_log, dt_bias, state, conv, index, gate_kind, lower_bound,
                             scale, block_v, num_warps, f_b_weight)
