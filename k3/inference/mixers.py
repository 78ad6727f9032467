"""The token mixers of an engine step (SPEC §7): where each KDA and MLA layer's state comes from, handed to the
model as ``K3ForCausalLM.forward(..., mixer=...)``. Both call back into the layers' own pieces, and both are
``InferenceMixer``s: the FFN and depth fast paths, and the fused projections, are ``k3.inference.fast``'s.

Legend: N sequences in a prefill batch, T packed new tokens, B decode rows, D hidden, H heads, K KDA head dim,
R kv_lora_rank, Dr rope dim, Tp tokens per page.

- ``PrefillMixer``: the new tokens of N sequences packed in one row [1,T] (cu_seqlens). KDA layers run the
  chunked kernel over all of them at once from their states in the pool (gathered, then written back: a
  prefill chunk reads and writes each state once). MLA layers write the new latents into the pages, then each
  sequence's queries attend over its whole context (cache + new tokens), expanded per head, with a causal
  mask aligned to the bottom right.
- ``DecodeMixer``: one token per row. KDA layers update their states IN PLACE (``k3::kda_decode_paged``: the
  short convs' tails and the recurrent state, in the pool, nothing copied; on CUDA one fused kernel that reads
  q, k, v, f_a and b as the projection's slices and applies the gate's second projection itself); MLA layers
  write the new latent into its page and attend over the pages in place through the page table
  (``k3::mla_decode_paged``). Both are registered as torch custom ops that find the pool by key, so
  ``torch.compile`` treats them as opaque kernels and the pool never becomes a graph input (the same device
  buffers serve every CUDA-graph replay).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from ..ops import kda as kda_ops
from ..ops.kda.decode import kda_decode
from ..ops.mla_decode import mla_decode_append
from .fast import InferenceMixer, fused_parts, kda_output
from .pool import PagePool

_POOLS: dict[int, PagePool] = {}


def register_pool(pool: PagePool) -> int:
    """Make ``pool`` reachable from the custom ops by an integer key (a compile-time constant)."""
    key = id(pool)
    _POOLS[key] = pool
    return key


def release_pool(key: int) -> None:
    _POOLS.pop(key, None)


# ---- the decode kernels as custom ops ---------------------------------------------------------------------------
@torch.library.custom_op("k3::kda_decode_paged", mutates_args=())
def kda_decode_paged(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, f_a: torch.Tensor, f_b: torch.Tensor,
                     b: torch.Tensor, w_q: torch.Tensor, w_k: torch.Tensor, w_v: torch.Tensor, A_log: torch.Tensor,
                     dt_bias: torch.Tensor, index: torch.Tensor, pool_key: int, layer: int, gate_kind: str,
                     lower_bound: float, backend: str) -> torch.Tensor:
    """q, k, v [B,H*K] pre-conv, f_a [B,K] the gate's low-rank input and f_b [H*K,K] its second projection's
    weight, b [B,H] raw beta, each read through its strides (slices of the fused projection's output) -> o [B,H,V]
    (q's dtype); the KDA state and conv tails of KDA layer ``layer`` of each row (page ``index[b]``) are updated
    in place in the pool."""
    pool = _POOLS[pool_key]
    return kda_decode(q, k, v, f_a, b, (w_q, w_k, w_v), A_log, dt_bias, pool.kda_state(layer), pool.kda_conv(layer),
                      index, gate_kind, lower_bound, backend=backend, f_b_weight=f_b)


@kda_decode_paged.register_fake
def _(q, k, v, f_a, f_b, b, w_q, w_k, w_v, A_log, dt_bias, index, pool_key, layer, gate_kind, lower_bound, backend):
    B, H = b.shape
    return q.new_empty(B, H, v.shape[-1] // H)


@torch.library.custom_op("k3::mla_decode_paged", mutates_args=())
def mla_decode_paged(q_lat: torch.Tensor, q_pe: torch.Tensor, latent: torch.Tensor, page_table: torch.Tensor,
                     positions: torch.Tensor, pool_key: int, layer: int, scale: float) -> torch.Tensor:
    """q_lat [B,H,R] fp32, q_pe [B,H,Dr]; latent [B,R+Dr] the new token's; page_table [B,maxP] int32; positions
    [B] the new token's position (= tokens already cached). Writes the latent into its page, then attends over
    positions + 1 tokens in place. Returns o_lat [B,H,R] fp32."""
    cache = _POOLS[pool_key].mla_view()[:, :, layer]  # [P,Tp,R+Dr], strided
    return mla_decode_append(q_lat, q_pe, latent, cache, page_table, positions, scale)


@mla_decode_paged.register_fake
def _(q_lat, q_pe, latent, page_table, positions, pool_key, layer, scale):
    return q_lat.new_empty(q_lat.shape, dtype=torch.float32)


class DecodeMixer(InferenceMixer):
    """One decode token per row; the step's device tables: ``positions`` [B] (tokens cached before this one),
    ``page_table`` [B,maxP] int32 (MLA pages), ``kda_index`` [B,kda_pages] long (KDA pages)."""

    def __init__(self, pool_key: int, kda_slot: dict[int, int], mla_slot: dict[int, int], records_per_page: int,
                 positions: torch.Tensor, page_table: torch.Tensor, kda_index: torch.Tensor):
        self.pool_key, self.kda_slot, self.mla_slot, self.per_page = pool_key, kda_slot, mla_slot, records_per_page
        self.positions, self.page_table, self.kda_index = positions, page_table, kda_index

    def attend(self, layer, x: torch.Tensor) -> torch.Tensor:
        if layer.kind == "kda":
            return self._kda(layer.self_attn, self.kda_slot[layer.layer_idx], x)
        return self._mla(layer.self_attn, self.mla_slot[layer.layer_idx], x)

    def _kda(self, attn, slot: int, x: torch.Tensor) -> torch.Tensor:
        q, k, v, fa, b, gate = attn.projections(x, fused_parts(attn, x), project_f=False)  # [B,1,HK] x3, [B,1,K],
        # [B,1,H], [B,1,HK]
        o = torch.ops.k3.kda_decode_paged(
            q[:, 0], k[:, 0], v[:, 0], fa[:, 0], attn.f_b_proj.weight, b[:, 0], attn.q_conv1d.weight,
            attn.k_conv1d.weight, attn.v_conv1d.weight, attn.A_log, attn.dt_bias,
            self.kda_index[:, slot // self.per_page], self.pool_key, slot, attn.gate_kind, float(attn.lower_bound),
            attn.backend)
        return kda_output(attn, o[:, None], gate)

    def _mla(self, mla, slot: int, x: torch.Tensor) -> torch.Tensor:
        inp = mla.project(x, self.positions[:, None], fused_parts(mla, x))
        o_lat = torch.ops.k3.mla_decode_paged(mla.absorb(inp.q_nope)[:, 0], inp.q_pe[:, 0],
                                              torch.cat([inp.c_kv, inp.k_pe], -1)[:, 0], self.page_table,
                                              self.positions, self.pool_key, slot, mla.scale)
        return mla.output(mla.unabsorb(o_lat[:, None]), inp.gate)


class PrefillMixer(InferenceMixer):
    """N sequences' new tokens packed in one row. ``cu_seqlens`` [N+1] over the packed row; ``starts`` the tokens
    each sequence has cached already (host ints); ``slots`` [T] the flat MLA slot (page * Tp + offset) of each new
    token; ``context_slots`` per sequence, [start + length] the slots of its whole context; ``kda_index``
    [N,kda_pages] long; ``positions`` [1,T] absolute positions (RoPE variants)."""

    def __init__(self, pool: PagePool, kda_slot: dict[int, int], mla_slot: dict[int, int], cu_seqlens: torch.Tensor,
                 starts: list[int], lengths: list[int], slots: torch.Tensor, context_slots: list[torch.Tensor],
                 kda_index: torch.Tensor, positions: torch.Tensor):
        self.pool, self.kda_slot, self.mla_slot = pool, kda_slot, mla_slot
        self.cu_seqlens, self.starts, self.lengths, self.slots = cu_seqlens, starts, lengths, slots
        self.context_slots, self.kda_index, self.positions = context_slots, kda_index, positions
        self.offsets = [0]  # each sequence's first token in the packed row (host ints)
        for n in lengths:
            self.offsets.append(self.offsets[-1] + n)

    def attend(self, layer, x: torch.Tensor) -> torch.Tensor:
        if layer.kind == "kda":
            return self._kda(layer.self_attn, self.kda_slot[layer.layer_idx], x)
        return self._mla(layer.self_attn, self.mla_slot[layer.layer_idx], x)

    def _kda(self, attn, slot: int, x: torch.Tensor) -> torch.Tensor:
        state, conv = self.pool.kda_state(slot), self.pool.kda_conv(slot)
        idx = self.kda_index[:, slot // self.pool.layout.records_per_page]
        h0, c0 = state[idx], conv[idx]  # [N,H,K,K] fp32, [N,3,HK,W-1]
        cu = self.cu_seqlens
        q, k, v, f, b, gate = attn.projections(x, fused_parts(attn, x))
        q, cq = attn.q_conv1d(q, c0[:, 0], cu, True, attn.backend)
        k, ck = attn.k_conv1d(k, c0[:, 1], cu, True, attn.backend)
        v, cv = attn.v_conv1d(v, c0[:, 2], cu, True, attn.backend)
        q, k, v, g, beta = attn.activations(q, k, v, f, b)
        o, hT = kda_ops.chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu,
                                  lower_bound=attn.kernel_lower_bound, backend=attn.backend)
        state.index_copy_(0, idx, hT.float())
        conv.index_copy_(0, idx, torch.stack([cq, ck, cv], dim=1).to(conv.dtype))
        return kda_output(attn, o, gate)

    def _mla(self, mla, slot: int, x: torch.Tensor) -> torch.Tensor:
        cache = self.pool.mla_view()[:, :, slot]  # [P,Tp,R+Dr], strided: indexed by (page, offset), in place
        Tp = cache.shape[1]
        inp = mla.project(x, self.positions, fused_parts(mla, x))  # latents [1,T,R], [1,T,Dr]
        cache[self.slots // Tp, self.slots % Tp] = torch.cat([inp.c_kv, inp.k_pe], dim=-1)[0].to(cache.dtype)
        q = torch.cat([inp.q_nope, inp.q_pe], dim=-1)[0]  # [T,H,Dn+Dr]
        H, R = mla.num_heads, mla.rank
        outs = []
        for i, (s, n) in enumerate(zip(self.starts, self.lengths)):
            ctx = self.context_slots[i]
            lat = cache[ctx // Tp, ctx % Tp].to(x.dtype)  # [s+n, R+Dr]: the sequence's whole context
            k_nope, v = mla.kv_b_proj(lat[:, :R]).view(s + n, H, mla.nope + mla.dv).split([mla.nope, mla.dv], -1)
            k = torch.cat([k_nope, lat[:, None, R:].expand(s + n, H, mla.pe)], dim=-1)
            lo = self.offsets[i]
            qi = q[lo: lo + n].transpose(0, 1)[None]  # [1,H,n,Dn+Dr]
            o = _causal_attention(qi, k.transpose(0, 1)[None], v.transpose(0, 1)[None], s, mla.scale)
            outs.append(o[0].transpose(0, 1).reshape(n, H * mla.dv))
        return mla.output(torch.cat(outs)[None], inp.gate)


def _causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, s: int, scale: float) -> torch.Tensor:
    """softmax(q k^T * scale + causal) v for ``n`` new queries after ``s`` cached tokens (query i sees keys <= s + i):
    q [1,H,n,D], k [1,H,s+n,D], v [1,H,s+n,Dv] -> [1,H,n,Dv]. On CUDA, SDPA's lower-right causal bias runs flash
    attention. On the CPU that bias falls back to the math path, which builds the n x (s+n) float scores and mask in
    several copies (19 s of a 2,048-token chunk at 8K context on ``tiny``); CPU flash attention takes a boolean mask
    but one head size, so v is zero-padded to D (its extra columns come out zero and are dropped): 5x faster there."""
    n = q.shape[2]
    if q.device.type != "cpu":
        mask = causal_lower_right(n, s + n) if s else None
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=not s, scale=scale)
    D, Dv = q.shape[-1], v.shape[-1]
    vp = F.pad(v, (0, D - Dv)) if Dv < D else v
    mask = torch.ones(n, s + n, dtype=torch.bool, device=q.device).tril(s) if s else None
    return F.scaled_dot_product_attention(q, k, vp, attn_mask=mask, is_causal=not s, scale=scale)[..., :Dv]
