"""GatedMLA: multi-head latent attention with NoPE and a sigmoid output gate (SPEC §2.2).

Legend: B batch, T query time, S key time, D hidden, H heads, Dn nope dim, Dr rope/pe dim, Dv value dim,
R kv_lora_rank. Per token the cache is c_kv (R) + k_pe (Dr), shared by all heads.

Two attention paths, chosen in ``forward``:
- naive (training, prefill): expand c_kv to per-head k_nope and v, then attention: over packed documents one
  flash-attention varlen call on CUDA (``attend_varlen``), else length groups of padded SDPA calls
  (``attend_documents``, the CPU path and the reference); one SDPA call for unpacked rows;
- absorbed (decode): fold W_uk into the query, attend in the R-dim latent space (MQA style), apply W_uv after.

Given a ``Statistics`` that asks for ``max_logit``, the forward also records the largest pre-softmax logit of each
head [H] fp32 (QK-clip, SPEC §5), returned in the model's output.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from typing import NamedTuple

from ...config import K3Config
from ...ops._triton import triton_available
from ...ops.max_logit import causal_max_logit
from ...ops.precision import compute_dtype
from ...ops.regions import region
from ...ops.varlen import GROUP_OVERHEAD, cached_plan, document_starts, grouped_documents
from ..fuse import fuse_linears, stacked_linear
from ..norm import RMSNorm
from ..stats import Statistics
from .rope import rope_frequencies, rotary, softmax_scale


def _half_cuda(w: torch.Tensor) -> bool:
    """A bf16/fp16 CUDA tensor: ``torch.bmm(..., out_dtype=torch.float32)`` multiplies it as stored."""
    return w.is_cuda and w.dtype in (torch.bfloat16, torch.float16)


class MLAInputs(NamedTuple):
    """Everything a GatedMLA layer computes from its input x [B,T,D] before attention."""

    q_nope: torch.Tensor  # [B,T,H,Dn]
    q_pe: torch.Tensor  # [B,T,H,Dr] (rotated when the layer uses RoPE)
    c_kv: torch.Tensor  # [B,T,R] normed: what the cache stores per token, with k_pe
    k_pe: torch.Tensor  # [B,T,Dr] shared by all heads (rotated when the layer uses RoPE)
    gate: torch.Tensor | None  # [B,T,H*Dv] output gate logits, None without the gate
    joined_query: torch.Tensor | None = None  # [B,T,H,Dn+Dr] when q_nope and q_pe are its two views (no RoPE)

    def query(self) -> torch.Tensor:
        """The whole query [B,T,H,Dn+Dr]: the projection's output itself when no RoPE touched q_pe (K3's NoPE
        layers: no copy, and no split to undo in the backward), else the concatenation."""
        if self.joined_query is not None:
            return self.joined_query
        return torch.cat([self.q_nope, self.q_pe], dim=-1)


def attend_documents(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, scale: float,
                     track_max_logit: bool = False, overhead: float = GROUP_OVERHEAD):
    """Causal attention within each packed document: q, k [1,H,T,Dk], v [1,H,T,Dv] -> (o [1,H,T,Dv], max logit
    [H] fp32 or None).

    Documents of similar length run together as one right-padded batch per group (``length_groups``: the work
    of a group is its count x its longest^2, so one 3000-token document no longer pads forty 50-token ones);
    plain causal SDPA per row is exact (a real query sees only keys at or before it; padding comes after every
    real position). ``overhead=inf`` pads every document to the longest, in one call. The groups' indices are
    built once per cu_seqlens tensor (``cached_plan``): no host read of the device per layer or group."""
    cu, plan = cached_plan(cu_seqlens, ("mla", overhead, q.device),
                           lambda cu: (cu, grouped_documents(cu, overhead, 2, q.device)))
    if len(cu) == 2:  # one document: no gather
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
        return o, (causal_max_logit(q, k, scale) if track_max_logit else None)
    outs, best = [], None
    for grp in plan.groups:
        qg, kg, vg = (grp.pad(x[0], dim=1).transpose(0, 1) for x in (q, k, v))  # [n,H,L,*]
        if track_max_logit:
            m = causal_max_logit(qg, kg, scale, valid=grp.valid)
            best = m if best is None else torch.maximum(best, m)
        og = F.scaled_dot_product_attention(qg, kg, vg, is_causal=True, scale=scale)  # [n,H,L,Dv]
        outs.append(og.transpose(0, 1))  # [H,n,L,Dv]
    return plan.scatter(outs, dim=1)[None], best


def _varlen_kernel():
    """torch's flash-attention varlen entry point (torch >= 2.10 on CUDA builds), or None."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn


def varlen_attention_available(q: torch.Tensor) -> bool:
    """One flash-attention varlen call can run these queries: CUDA, bf16/fp16, a head dim flash supports."""
    return (q.is_cuda and q.dtype in (torch.bfloat16, torch.float16) and q.shape[-1] <= 256 and q.shape[-1] % 8 == 0
            and _varlen_kernel() is not None)


def attend_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, scale: float,
                  track_max_logit: bool = False):
    """Causal attention within each packed document in ONE flash-attention varlen call: q, k [1,T,H,Dk], v [1,T,H,Dv]
    (bf16/fp16, CUDA) -> (o [1,T,H,Dv] in q's dtype, max logit [H] fp32 or None). No padding, no grouping: the kernel
    walks the documents itself (softmax and accumulation in fp32, the output rounded to q's dtype). Flash attention
    takes one head dim for q, k and v, so v is zero-padded to Dk and the output cut back (MLA: 192 vs 128). The
    lengths' maximum comes from the host values of cu_seqlens (``cached_plan``): no read of the device. QK-clip's
    statistic is not a by-product of the kernel: with ``track_max_logit`` it is computed exactly over the
    documents."""
    cu, longest = cached_plan(cu_seqlens, ("longest",), lambda cu: (cu, max(b - a for a, b in zip(cu, cu[1:]))))
    Dk, Dv = q.shape[-1], v.shape[-1]
    qt, kt, vt = q[0], k[0], v[0]  # [T,H,D]
    if Dv < Dk:
        vt = F.pad(vt, (0, Dk - Dv))
    cu32 = cu_seqlens.to(torch.int32)
    o = _varlen_kernel()(qt, kt, vt, cu32, cu32, longest, longest, scale=scale, window_size=(-1, 0))  # (-1, 0): causal
    m = documents_max_logit(q.transpose(1, 2), k.transpose(1, 2), cu_seqlens, scale) if track_max_logit else None
    return o[..., :Dv][None], m


def documents_max_logit(q: torch.Tensor, k: torch.Tensor, cu_seqlens: torch.Tensor, scale: float,
                        overhead: float = GROUP_OVERHEAD) -> torch.Tensor:
    """Per-head max of the causal within-document logits of packed q, k [1,H,T,Dk] -> [H] fp32 (QK-clip). On CUDA
    one kernel over the packed row, told each position's document start (``k3.ops.max_logit``); elsewhere the
    reference over the documents' length groups."""
    if q.is_cuda and triton_available():
        return causal_max_logit(q, k, scale, document_starts(cu_seqlens, q.device))
    cu, plan = cached_plan(cu_seqlens, ("mla", overhead, q.device),
                           lambda cu: (cu, grouped_documents(cu, overhead, 2, q.device)))
    best = None
    for grp in plan.groups:
        qg, kg = (grp.pad(x[0], dim=1).transpose(0, 1) for x in (q, k))  # [n,H,L,Dk]
        m = causal_max_logit(qg, kg, scale, valid=grp.valid)
        best = m if best is None else torch.maximum(best, m)
    return best


class GatedMLA(nn.Module):
    def __init__(self, config: K3Config, layer_idx: int = 0):
        super().__init__()
        D, H = config.hidden_size, config.num_attention_heads
        self.layer_idx, self.num_heads = layer_idx, H
        self.nope, self.pe, self.dv, self.rank = (config.qk_nope_head_dim, config.qk_rope_head_dim,
                                                  config.v_head_dim, config.kv_lora_rank)
        self.scale = softmax_scale(config.qk_head_dim, config.rope_scaling)
        self.use_rope, self.rope_theta, self.rope_scaling = not config.mla_use_nope, config.rope_theta, config.rope_scaling
        self.fp32_attention = True  # attention output kept in fp32 while training (SPEC §2.2)
        self.varlen_attention = True  # packed documents on CUDA: one flash varlen call (attend_varlen) when it can run
        qd = H * config.qk_head_dim
        self.q_lora = bool(config.q_lora_rank)  # the query through a low-rank bottleneck (q_a, norm, q_b)
        if self.q_lora:
            self.q_a_proj = nn.Linear(D, config.q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(config.q_lora_rank, eps=1e-6)
            self.q_b_proj = nn.Linear(config.q_lora_rank, qd, bias=False)
        else:
            self.q_proj = nn.Linear(D, qd, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(D, self.rank + self.pe, bias=False)
        self.kv_a_layernorm = RMSNorm(self.rank, eps=1e-6)
        self.kv_b_proj = nn.Linear(self.rank, H * (self.nope + self.dv), bias=False)  # per head: [k_nope | v]
        self.o_proj = nn.Linear(H * self.dv, D, bias=False)
        self.g_proj = nn.Linear(D, H * self.dv, bias=False) if config.mla_use_output_gate else None
        self.in_proj: torch.Tensor | None = None  # every projection of x in one tensor (fuse_projections)

    def fuse_projections(self) -> None:
        """Inference: the query's first projection, the latent projection and the output gate become one matmul."""
        first = self.q_a_proj if self.q_lora else self.q_proj
        self.in_proj, self._in_sizes = fuse_linears([first, self.kv_a_proj_with_mqa]
                                                    + ([self.g_proj] if self.g_proj is not None else []))

    def project(self, x: torch.Tensor, positions: torch.Tensor | None = None, parts=None) -> MLAInputs:
        """x [B,T,D] -> queries, the latents the cache stores, and the output gate (``positions`` [B,T] for RoPE).
        ``parts``: the first projections of x (query, latent, gate) when the caller computed them (inference's
        fused matmul, ``k3.layers.fuse``); else one matmul over their stacked weights (x's gradient one GEMM)."""
        B, T, _ = x.shape
        first = self.q_a_proj if self.q_lora else self.q_proj
        if parts is None:
            parts = stacked_linear(x, [first, self.kv_a_proj_with_mqa] + ([self.g_proj] if self.g_proj is not None
                                                                          else []))
        q, kv, gate = parts[0], parts[1], parts[2] if len(parts) > 2 else None
        if self.q_lora:
            q = self.q_b_proj(self.q_a_layernorm(q))
        q = q.view(B, T, self.num_heads, self.nope + self.pe)
        q_nope, q_pe = q.split([self.nope, self.pe], dim=-1)
        c_kv, k_pe = kv.split([self.rank, self.pe], dim=-1)
        if self.use_rope:
            freqs = rope_frequencies(self.pe, self.rope_theta, self.rope_scaling, x.device)  # shared by q and k
            q_pe, k_pe = rotary(q_pe, positions, freqs), rotary(k_pe, positions, freqs)
        return MLAInputs(q_nope, q_pe, self.kv_a_layernorm(c_kv), k_pe, gate, None if self.use_rope else q)

    def output(self, o: torch.Tensor, gate: torch.Tensor | None) -> torch.Tensor:
        """o [B,T,H*Dv] attention output (any float dtype) -> times sigmoid(gate) in fp32 -> o_proj -> [B,T,D].
        The gating is the named region "mla_output" (``k3 train --compile`` fuses the upcasts, sigmoid, product and
        the cast for the projection into one kernel each way)."""
        return self.o_proj(region("mla_output", _gated_output, o, gate, self.o_proj.weight.dtype))

    def forward(self, x: torch.Tensor, cu_seqlens: torch.Tensor | None = None, positions: torch.Tensor | None = None,
                stats: Statistics | None = None) -> torch.Tensor:
        """Naive path over a whole (packed) sequence: training and prefill without a cache. ``stats``: where the
        per-head max logits go when it asks for them (QK-clip)."""
        B, T, _ = x.shape
        H = self.num_heads
        if self.use_rope and positions is None:
            positions = _positions(B, T, cu_seqlens, x.device)
        inp = self.project(x, positions)
        k_nope, v = self.kv_b_proj(inp.c_kv).view(B, T, H, self.nope + self.dv).split([self.nope, self.dv], dim=-1)
        q = inp.query()  # [B,T,H,Dn+Dr]
        k = torch.cat([k_nope, inp.k_pe[:, :, None, :].expand(B, T, H, self.pe)], dim=-1)
        track = stats is not None and stats.max_logit is not None
        if cu_seqlens is not None and B != 1:
            raise ValueError(f"packed documents (cu_seqlens) come in batch 1; got batch {B}")
        if cu_seqlens is not None and self.varlen_attention and varlen_attention_available(q):
            # packed documents on CUDA: one flash varlen kernel over all documents (bf16 in, fp32 accumulation)
            o, m = attend_varlen(q, k, v, cu_seqlens, self.scale, track)  # [1,T,H,Dv]
        else:
            q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [B,H,T,*]
            if self.fp32_attention and self.training:
                q, k, v = q.float(), k.float(), v.float()
            if cu_seqlens is not None:  # packed documents (B = 1): length groups of padded SDPA calls
                o, m = attend_documents(q, k, v, cu_seqlens, self.scale, track)
            else:
                o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale)
                m = causal_max_logit(q, k, self.scale) if track else None
            o = o.transpose(1, 2)  # [B,T,H,Dv]
        if track:
            stats.add_max_logit(self.layer_idx, m)
        return self.output(o.reshape(B, T, H * self.dv), inp.gate)

    def absorbed_weights(self):
        """W_uk [H,Dn,R] and W_uv [H,Dv,R], views into kv_b_proj."""
        w = self.kv_b_proj.weight.view(self.num_heads, self.nope + self.dv, self.rank)
        return w[:, : self.nope], w[:, self.nope:]

    def absorb(self, q_nope: torch.Tensor) -> torch.Tensor:
        """q_nope [B,T,H,Dn] -> q_lat [B,T,H,R] fp32: W_uk folded into the query, so scores are q_lat . c_kv.
        bf16/fp16 operands on CUDA: one batched matmul with fp32 accumulation and output (``out_dtype``), the same
        products and sums as the fp32 einsum of the widened operands, without widening W_uk in every decode step."""
        w_uk, _ = self.absorbed_weights()
        if _half_cuda(w_uk) and q_nope.dtype == w_uk.dtype:
            B, T, H, Dn = q_nope.shape
            q = q_nope.reshape(B * T, H, Dn).transpose(0, 1)  # [H,BT,Dn]
            return torch.bmm(q, w_uk, out_dtype=torch.float32).transpose(0, 1).reshape(B, T, H, -1)
        return torch.einsum("bthn,hnr->bthr", q_nope.float(), w_uk.float())

    def unabsorb(self, o_lat: torch.Tensor) -> torch.Tensor:
        """o_lat [B,T,H,R] (attention output in the latent space) -> o [B,T,H*Dv] fp32: W_uv applied after.
        A bf16/fp16 W_uv on CUDA: o_lat is rounded to W_uv's dtype (as the naive path's bf16 attention output is)
        and multiplied with fp32 accumulation and output, W_uv read as stored."""
        B, T, H, R = o_lat.shape
        _, w_uv = self.absorbed_weights()
        if _half_cuda(w_uv):
            o = o_lat.to(w_uv.dtype).reshape(B * T, H, R).transpose(0, 1)  # [H,BT,R]
            return torch.bmm(o, w_uv.transpose(1, 2), out_dtype=torch.float32).transpose(0, 1).reshape(B, T, -1)
        return torch.einsum("bthr,hvr->bthv", o_lat.float(), w_uv.float()).reshape(B, T, -1)

    def attend_latent(self, inp: MLAInputs, c_kv: torch.Tensor, k_pe: torch.Tensor,
                      mask: torch.Tensor | None) -> torch.Tensor:
        """Absorbed attention of ``inp``'s queries over c_kv [B,S,R], k_pe [B,S,Dr] (the cache INCLUDING the new
        tokens) in the latent space; mask [B,T,S] boolean (True = may attend) or None. -> o [B,T,H*Dv] fp32."""
        scores = (torch.einsum("bthr,bsr->bhts", self.absorb(inp.q_nope), c_kv.float())
                  + torch.einsum("bthp,bsp->bhts", inp.q_pe.float(), k_pe.float())) * self.scale
        if mask is not None:
            scores = scores.masked_fill(~mask[:, None], float("-inf"))
        return self.unabsorb(torch.einsum("bhts,bsr->bthr", scores.softmax(-1), c_kv.float()))

    def attend_absorbed(self, x: torch.Tensor, c_kv: torch.Tensor, k_pe: torch.Tensor,
                        mask: torch.Tensor | None, positions: torch.Tensor | None = None) -> torch.Tensor:
        """The whole layer on x [B,T,D] over a given cache (c_kv, k_pe including x's own latents), absorbed."""
        inp = self.project(x, positions)
        return self.output(self.attend_latent(inp, c_kv, k_pe, mask), inp.gate)


def _gated_output(o: torch.Tensor, gate: torch.Tensor | None, weight_dtype: torch.dtype) -> torch.Tensor:
    """The "mla_output" region: o times sigmoid(gate), both in fp32 (SPEC §2.2: the attention output is fp32 in
    training), rounded to the dtype the output projection multiplies in (autocast's, else its weight's)."""
    if gate is not None:
        o = o.float() * torch.sigmoid(gate.float())
    return compute_dtype(o.to(weight_dtype))


def _positions(B, T, cu_seqlens, device):
    pos = torch.arange(T, device=device)
    if cu_seqlens is not None:
        cu = cu_seqlens.to(device)
        inner = cu[1:-1]
        starts = torch.zeros(T + 1, dtype=torch.long, device=device)  # slot T takes boundaries at or past the end
        # each boundary adds its previous doc's length (no boolean mask: it would wait for the GPU)
        starts.index_add_(0, inner.clamp(max=T), inner - cu[:-2])
        pos = pos - starts[:T].cumsum(0)
    return pos[None].expand(B, T)
