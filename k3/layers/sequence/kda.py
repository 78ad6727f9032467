"""KimiDeltaAttention: the linear-attention token mixer of 3 in 4 K3 layers (SPEC §2.1).

Legend: B batch, T time, D hidden, H heads, K = V head dim, W conv width, N sequences.
proj -> causal short conv -> SiLU -> (q, k: L2 norm per head); gate from a rank-K bottleneck;
beta = sigmoid(b_proj x); delta-rule recurrence; per-head RMSNorm gated by sigmoid(g_proj x); o_proj.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ...config import K3Config
from ...ops import kda as kda_ops
from ...ops.norms import gated_rms_norm, l2_norm
from ...ops.regions import region
from ...ops.short_conv import short_conv
from ..fuse import fuse_linears, stacked_linear


@dataclass
class KDAState:
    """Per-request decode state, fixed size: the recurrent state and the three conv tails."""

    recurrent: torch.Tensor  # [N,H,K,V] fp32
    conv_q: torch.Tensor  # [N,H*K,W-1]
    conv_k: torch.Tensor
    conv_v: torch.Tensor


class ShortConvolution(nn.Module):
    """Depthwise causal conv; its parameter is ``weight`` [C,1,W] like the checkpoint's ``*_conv1d.weight``."""

    def __init__(self, channels: int, width: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(channels, 1, width))
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))  # nn.Conv1d's default

    def forward(self, x, state=None, cu_seqlens=None, output_final_state=False, backend="auto"):
        return short_conv(x, self.weight, state, cu_seqlens, output_final_state, backend=backend)


class KimiDeltaAttention(nn.Module):
    def __init__(self, config: K3Config, layer_idx: int = 0):
        super().__init__()
        D, H, K = config.hidden_size, config.kda_num_heads, config.kda_head_dim
        self.layer_idx, self.num_heads, self.head_dim = layer_idx, H, K
        self.gate_kind, self.lower_bound = config.gate, config.gate_lower_bound
        self.backend = "auto"  # "auto" | "torch" | "fla", see k3.ops.kda
        self.q_proj = nn.Linear(D, H * K, bias=False)
        self.k_proj = nn.Linear(D, H * K, bias=False)
        self.v_proj = nn.Linear(D, H * K, bias=False)
        W = config.short_conv_kernel_size
        self.q_conv1d, self.k_conv1d, self.v_conv1d = (ShortConvolution(H * K, W) for _ in range(3))
        self.f_a_proj = nn.Linear(D, K, bias=False)  # gate bottleneck, rank = head dim
        self.f_b_proj = nn.Linear(K, H * K, bias=False)
        self.b_proj = nn.Linear(D, H, bias=False)
        self.full_rank_gate = config.use_full_rank_gate  # else Kimi Linear's low-rank output gate, g_b(g_a x)
        if self.full_rank_gate:
            self.g_proj = nn.Linear(D, H * K, bias=False)
        else:  # Kimi Linear's low-rank output gate
            self.g_a_proj = nn.Linear(D, K, bias=False)
            self.g_b_proj = nn.Linear(K, H * K, bias=False)
        self.A_log = nn.Parameter(torch.zeros(H))
        self.dt_bias = nn.Parameter(torch.zeros(H * K))
        self.o_norm = _HeadNorm(K, config.rms_norm_eps)
        self.o_proj = nn.Linear(H * K, D, bias=False)
        self.in_proj: torch.Tensor | None = None  # every projection of x in one tensor (fuse_projections)
        self.reset_gate_parameters()

    @torch.no_grad()
    def reset_gate_parameters(self, dt_min: float = 1e-3, dt_max: float = 0.1):
        """Start with slow forgetting: at z = 0 each channel's decay -g is log-uniform in [dt_min, dt_max]
        (Mamba's dt init, mapped through the gate's own nonlinearity)."""
        dt = torch.exp(torch.empty_like(self.dt_bias).uniform_(math.log(dt_min), math.log(dt_max)))
        self.A_log.zero_()
        if self.gate_kind == "lower_bound":
            self.dt_bias.copy_(torch.logit(dt / -self.lower_bound))
        else:
            self.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))  # inverse softplus

    def fuse_projections(self) -> None:
        """Inference: q, k, v, f_a, b and the output gate's first projection become one matmul (``k3.layers.fuse``)."""
        gate = self.g_proj if self.full_rank_gate else self.g_a_proj
        self.in_proj, self._in_sizes = fuse_linears([self.q_proj, self.k_proj, self.v_proj, self.f_a_proj,
                                                     self.b_proj, gate])

    # The token mixer in three pieces, so that inference (paged, in-place state) and context parallelism
    # (halo'd convs, KCP) supply only the short convs and the recurrence: projections -> [convs] ->
    # activations -> [kernel] -> output.
    def projections(self, x: torch.Tensor, parts=None, project_f: bool = True):
        """x [B,T,D] -> q, k, v before their short convs [B,T,H*K] each, the gate's raw input f [B,T,H,K]
        (before A_log and dt_bias), the raw beta logits b [B,T,H] and the output gate's logits [B,T,H*K].
        ``parts``: the six first projections of x (q, k, v, f_a, b, the output gate's first) when the caller computed
        them (inference's fused matmul, ``k3.layers.fuse``); else ``_stacked``'s matmul.
        ``project_f=False``: f is the gate's low-rank input f_a [B,T,K] instead (the decode kernel applies
        ``f_b_proj`` itself)."""
        if parts is None:
            qkv, fa, b, g = self._stacked(x)
            q, k, v = qkv.split(self.q_proj.out_features, dim=-1)
        else:
            q, k, v, fa, b, g = parts
        return (q, k, v, *self._gates(fa, b, g, project_f))

    def _stacked(self, x: torch.Tensor):
        """q, k, v (side by side [B,T,3*H*K]), f_a and the output gate's first projection as ONE matmul over their
        stacked weights (one launch instead of five, forward and backward, and x's gradient two GEMMs instead of six
        and five adds), and b [B,T,H]. b_proj (H outputs) stays its own matmul: with it the stacked width is not a
        multiple of 8 and cuBLAS falls back to slow unaligned kernels."""
        gate_proj = self.g_proj if self.full_rank_gate else self.g_a_proj
        qkv, fa, g = stacked_linear(x, [self.q_proj, self.k_proj, self.v_proj, self.f_a_proj, gate_proj],
                                    [3 * self.q_proj.out_features, self.f_a_proj.out_features, gate_proj.out_features])
        return qkv, fa, self.b_proj(x), g

    def _gates(self, fa, b, g, project_f: bool = True):
        """-> f (f_b_proj applied unless ``project_f=False``), b, the output gate's logits [B,T,H*K]."""
        if not self.full_rank_gate:  # Kimi Linear's low-rank output gate
            g = self.g_b_proj(g)
        if not project_f:
            return fa, b, g
        B, T, _ = fa.shape
        return self.f_b_proj(fa).view(B, T, self.num_heads, self.head_dim), b, g

    def activations(self, q, k, v, f, b, conv_silu: bool = False):
        """After the convs: per-head L2-normalised q, k and v [B,T,H,K], log-decay g [B,T,H,K] fp32, beta
        [B,T,H] fp32. ``conv_silu``: q, k, v come before the short convs' SiLU (``stateless_inputs``), applied here
        first.
        A named region ("kda_activations"): ``k3 train --compile`` fuses its elementwise chains (the SiLU with
        the L2 norms)."""
        return region("kda_activations", _activations, q, k, v, f, b, self.A_log, self.dt_bias, self.num_heads,
                      self.head_dim, self.gate_kind, self.lower_bound, conv_silu)

    @property
    def kernel_lower_bound(self) -> float | None:
        """The gate's floor as the kernels take it (None for the unbounded softplus gate)."""
        return self.lower_bound if self.gate_kind == "lower_bound" else None

    def output(self, o: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """o [B,T,H,K] from the recurrence -> per-head RMSNorm gated by sigmoid(gate) -> o_proj -> [B,T,D]."""
        B, T, H, K = o.shape
        o = self.o_norm(o, gate.view(B, T, H, K))
        return self.o_proj(o.reshape(B, T, H * K).to(gate.dtype))

    def stateless_inputs(self, x: torch.Tensor, cu_seqlens: torch.Tensor | None = None, conv=None):
        """``projections`` and the short convs without a decode state (training, a plain forward): ONE depthwise conv
        over the stacked q/k/v channels (the same per-channel arithmetic; one launch instead of three). -> q, k, v
        [B,T,H*K] after their convs and before the convs' SiLU (views of one tensor), f [B,T,H,K], b [B,T,H], gate
        [B,T,H*K]. The SiLU is left to ``activations(..., conv_silu=True)``, where it fuses with the L2 norms and the
        conv's backward has no activation to recompute. ``conv(y, taps) -> y`` replaces the short conv, without its
        activation (context parallelism's halo'd conv)."""
        qkv, fa, b, g = self._stacked(x)
        taps = torch.cat([self.q_conv1d.weight, self.k_conv1d.weight, self.v_conv1d.weight])
        qkv = conv(qkv, taps) if conv is not None else short_conv(qkv, taps, None, cu_seqlens, False,
                                                                  activation=False, backend=self.backend)[0]
        return (*qkv.split(self.q_proj.out_features, dim=-1), *self._gates(fa, b, g))

    def forward(self, x: torch.Tensor, cu_seqlens: torch.Tensor | None = None, state: KDAState | None = None,
                output_state: bool = False) -> tuple[torch.Tensor, KDAState | None]:
        T = x.shape[1]
        want = output_state or state is not None
        stateless = not want
        if want:  # a decode state in and out: each conv keeps its own tail
            q, k, v, f, b, gate = self.projections(x)
            q, cq = self.q_conv1d(q, state and state.conv_q, cu_seqlens, want, self.backend)
            k, ck = self.k_conv1d(k, state and state.conv_k, cu_seqlens, want, self.backend)
            v, cv = self.v_conv1d(v, state and state.conv_v, cu_seqlens, want, self.backend)
        else:
            q, k, v, f, b, gate = self.stateless_inputs(x, cu_seqlens)
        q, k, v, g, beta = self.activations(q, k, v, f, b, conv_silu=stateless)  # stateless: before the SiLU
        h0 = state.recurrent if state is not None else None
        if T == 1 and cu_seqlens is None:  # one token: the recurrence itself on a fixed-size state
            o, hT = kda_ops.recurrent_kda(q, k, v, g, beta, initial_state=h0, output_final_state=want,
                                          lower_bound=self.kernel_lower_bound, backend=self.backend)
        else:  # training / prefill: chunkwise-parallel form
            o, hT = kda_ops.chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=want,
                                      cu_seqlens=cu_seqlens, lower_bound=self.kernel_lower_bound,
                                      backend=self.backend)
        return self.output(o, gate), (KDAState(hT, cq, ck, cv) if want else None)


def _activations(q, k, v, f, b, A_log, dt_bias, H: int, K: int, gate_kind: str, lower_bound: float,
                 conv_silu: bool = False):
    B, T, _ = q.shape
    if conv_silu:
        q, k, v = F.silu(q), F.silu(k), F.silu(v)
    g = kda_ops.kda_gate(f, A_log, dt_bias, gate_kind, lower_bound)
    return (l2_norm(q.view(B, T, H, K)), l2_norm(k.view(B, T, H, K)), v.view(B, T, H, K), g,
            torch.sigmoid(b.float()))


class _HeadNorm(nn.Module):
    """Per-head RMSNorm over the head's K channels, one weight shared by all heads, gated by sigmoid."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, o: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return gated_rms_norm(o, gate, self.weight, self.eps)
