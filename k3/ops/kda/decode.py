"""One KDA decode token per row, on states that stay where they live (SPEC §2.1, §7).

Legend: B rows, H heads, K = V head dim, W conv width, P pages (state slots). ``state`` [P,H,K,V] fp32 and
``conv`` [P,3,H*K,W-1] are strided views of the engine's page pool; row b's state is slot ``index[b]``.
Per row, from the three pre-conv projections x [3,H*K] (q, k, v), the raw gate input f [H,K] and the raw beta
logit b [H]:

    y = SiLU(conv(tail ++ x)),  tail <- last W-1 inputs        (the short convs, q/k/v)
    q, k = L2Norm(y_q), L2Norm(y_k) per head;  v = y_v;  g = gate(f);  beta = sigmoid(b)
    S <- (I - beta k k^T) Diag(e^g) S + beta k v^T;  o = S^T q * scale        (the recurrence, one step)

and both the tail and S are written back into the same slot.
- ``kda_decode_reference``: gathers the slots, runs ``reference.recurrent_kda``, scatters back (CPU; oracle).
- on CUDA: our Triton kernel for the convs (in place), then fla-core's ``fused_recurrent_kda`` with state
  indices (``ssm_state_indices``, in-place final state), which also applies the L2 norms, the gate and the beta
  sigmoid inside the kernel. No state is copied.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..norms import l2_norm
from . import reference
from .fla import fla_available
from .gate import kda_gate

__all__ = ["kda_decode", "kda_decode_reference", "conv_decode_reference"]


def conv_decode_reference(x3: torch.Tensor, weights, conv: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """x3 [B,3,HK] new inputs; weights (w_q, w_k, w_v) each [HK,1,W]; conv [P,3,HK,W-1] tails (updated in place
    at ``index``). Returns SiLU(conv) [B,3,HK] fp32."""
    w = torch.stack([wt.view(wt.shape[0], -1) for wt in weights]).float()  # [3,HK,W]
    tails = conv[index].float()  # [B,3,HK,W-1]
    window = torch.cat([tails, x3.float()[..., None]], dim=-1)  # [B,3,HK,W], oldest first
    conv.index_copy_(0, index, window[..., 1:].to(conv.dtype))
    return F.silu((window * w).sum(-1))


def kda_decode_reference(x3, f, b, conv_weights, A_log, dt_bias, state, conv, index, gate_kind: str = "lower_bound",
                         lower_bound: float = -5.0, scale: float | None = None) -> torch.Tensor:
    """See the module docstring; returns o [B,H,V] in x3's dtype. ``index`` [B] long."""
    B, H, K = f.shape
    y = conv_decode_reference(x3, conv_weights, conv, index)  # [B,3,HK]
    q, k = l2_norm(y[:, 0].view(B, 1, H, K)), l2_norm(y[:, 1].view(B, 1, H, K))
    v = y[:, 2].view(B, 1, H, K)
    g = kda_gate(f[:, None], A_log, dt_bias, gate_kind, lower_bound)
    beta = torch.sigmoid(b.float())[:, None]
    o, s = reference.recurrent_kda(q, k, v, g, beta, scale, initial_state=state[index], output_final_state=True)
    state.index_copy_(0, index, s)
    return o[:, 0].to(x3.dtype)


def kda_decode(x3, f, b, conv_weights, A_log, dt_bias, state, conv, index, gate_kind: str = "lower_bound",
               lower_bound: float = -5.0, scale: float | None = None, backend: str = "auto") -> torch.Tensor:
    """The fused path on CUDA with fla-core (``backend`` "auto" or "fla"), the reference elsewhere."""
    from . import resolve_backend

    if resolve_backend(backend, x3) == "fla" and fla_available(x3):
        return _kda_decode_fused(x3, f, b, conv_weights, A_log, dt_bias, state, conv, index, gate_kind, lower_bound,
                                 scale)
    return kda_decode_reference(x3, f, b, conv_weights, A_log, dt_bias, state, conv, index, gate_kind, lower_bound,
                                scale)


def _kda_decode_fused(x3, f, b, conv_weights, A_log, dt_bias, state, conv, index, gate_kind, lower_bound, scale):
    from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd

    from ._decode_triton import conv_decode

    B, H, K = f.shape
    y = conv_decode(x3, conv_weights, conv, index)  # [3,B,HK] in x3's dtype: q, k, v each contiguous
    v = y[2].view(B, 1, H, K)
    # fla's kernel indexes every input as a contiguous [B,T,H,...] tensor (its raw forward, unlike its autograd
    # wrapper, does not make them so): the engine's f and b are column slices of the fused projection's output
    f, b = f.reshape(B, 1, H, K).contiguous(), b.reshape(B, 1, H).contiguous()
    o, _ = fused_recurrent_kda_fwd(
        q=y[0].view(B, 1, H, K), k=y[1].view(B, 1, H, K), v=v, g=f, out=torch.empty_like(v), beta=b, A_log=A_log, dt_bias=dt_bias, scale=scale, initial_state=state,
        inplace_final_state=True, ssm_state_indices=index, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
        use_beta_sigmoid_in_kernel=True, lower_bound=lower_bound if gate_kind == "lower_bound" else None)
    return o[:, 0]
