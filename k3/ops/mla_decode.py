"""Absorbed MLA decode attention over paged latents, read in place (SPEC §2.2, §7).

Legend: B rows (sequences), H heads, R kv_lora_rank, Dr rope dim, P pages, Tp tokens per page, N context tokens.
The query is already in the latent space (``GatedMLA.absorb``): for row b and head h,

    s_t = (q_lat[b,h] . c_t + q_pe[b,h] . pe_t) * scale,   o_lat[b,h] = sum_t softmax(s)_t c_t,   t < n_b,

where token t of row b is latent ``cache[page_table[b, t // Tp], t % Tp]`` = [c_t (R) | pe_t (Dr)]. Every head
shares the same latents (MQA in the latent space), so one pass over a row's pages serves all heads.

- ``mla_decode_reference``: gathers each row's context and attends in fp32 (CPU, and the test oracle).
- ``mla_decode_triton``: flash-decoding. Each program takes one row, one of ``splits`` slices of its context and a
  block of heads; it streams the slice's latents page by page straight from the pool (online softmax, fp32
  accumulators, tensor-core dots), then a second kernel merges the slices by their log-sum-exp. The grid is
  static (a CUDA graph replays it at any context length) and the work follows each row's length.
"""

from __future__ import annotations

import torch

from ._triton import triton_available

__all__ = ["mla_decode", "mla_decode_append", "mla_decode_reference", "mla_decode_triton"]


def mla_decode_reference(q_lat: torch.Tensor, q_pe: torch.Tensor, cache: torch.Tensor, page_table: torch.Tensor,
                         lengths: torch.Tensor, scale: float) -> torch.Tensor:
    """q_lat [B,H,R], q_pe [B,H,Dr]; cache [P,Tp,R+Dr] (one MLA layer's latents, any strides); page_table [B,maxP]
    int; lengths [B] int (tokens to attend, >= 1). Returns o_lat [B,H,R] fp32."""
    B, H, R = q_lat.shape
    Tp = cache.shape[1]
    n_max = int(lengths.max())
    t = torch.arange(n_max, device=cache.device)
    pages = page_table[:, (t // Tp).clamp(max=page_table.shape[1] - 1)].long()  # [B,N]
    lat = cache[pages, (t % Tp)[None, :].expand(B, -1)].float()  # [B,N,R+Dr]
    c, pe = lat[..., :R], lat[..., R:]
    s = (torch.einsum("bhr,bnr->bhn", q_lat.float(), c) + torch.einsum("bhp,bnp->bhn", q_pe.float(), pe)) * scale
    s = s.masked_fill((t[None, :] >= lengths[:, None].to(t.device))[:, None, :], float("-inf"))
    return torch.einsum("bhn,bnr->bhr", s.softmax(-1), c)


def mla_decode(q_lat, q_pe, cache, page_table, lengths, scale: float, splits: int | None = None) -> torch.Tensor:
    """Triton on CUDA (when importable), the reference elsewhere. Same arguments as ``mla_decode_reference``."""
    if cache.is_cuda and triton_available():
        return mla_decode_triton(q_lat, q_pe, cache, page_table, lengths, scale, splits)
    return mla_decode_reference(q_lat, q_pe, cache, page_table, lengths, scale)


def mla_decode_append(q_lat, q_pe, latent, cache, page_table, positions, scale: float) -> torch.Tensor:
    """A decode step: write each row's new latent [B,R+Dr] at token ``positions[b]`` (the tokens cached before it)
    of its pages, then attend over positions + 1 tokens. In place; Triton on CUDA, the reference elsewhere."""
    if cache.is_cuda and triton_available():
        from ._mla_decode_triton import write_latents

        write_latents(latent, cache, page_table, positions)
        return mla_decode_triton(q_lat, q_pe, cache, page_table, positions, scale, length_offset=1)
    pos = positions.long()
    page = page_table.gather(1, (pos // cache.shape[1])[:, None]).squeeze(1).long()
    cache[page, pos % cache.shape[1]] = latent.to(cache.dtype)
    return mla_decode_reference(q_lat, q_pe, cache, page_table, pos + 1, scale)


def _pow2(n: int, least: int = 16) -> int:
    return max(least, 1 << (max(n, 1) - 1).bit_length())


def default_splits(batch: int, head_blocks: int, sms: int = 132) -> int:
    """Slices per row: enough programs to fill the chip about twice, at most 64."""
    return max(1, min(64, -(-2 * sms // (batch * head_blocks))))


def mla_decode_triton(q_lat, q_pe, cache, page_table, lengths, scale: float, splits: int | None = None,
                      block_n: int = 64, length_offset: int = 0) -> torch.Tensor:
    """The flash-decoding kernels (row b attends over lengths[b] + length_offset tokens); also runs under
    ``TRITON_INTERPRET=1`` on CPU tensors (tests)."""
    from ._mla_decode_triton import mla_decode_kernels

    B, H, R = q_lat.shape
    Dr = q_pe.shape[-1]
    if cache.stride(-1) != 1 or cache.shape[-1] != R + Dr:
        raise ValueError(f"cache must be [P,Tp,R+Dr] = [P,Tp,{R + Dr}] with unit stride in the last dim; got "
                         f"shape {tuple(cache.shape)} strides {cache.stride()}")
    block_h = min(_pow2(H), 64)
    head_blocks = -(-H // block_h)
    splits = splits or default_splits(B, head_blocks)
    q_lat, q_pe = (x if x.stride(-1) == 1 else x.contiguous() for x in (q_lat, q_pe))  # rows may be strided
    return mla_decode_kernels(q_lat, q_pe, cache, page_table, lengths, length_offset, float(scale), splits, block_h,
                              min(block_n, _pow2(cache.shape[1])), _pow2(R), _pow2(Dr))
