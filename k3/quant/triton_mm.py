"""Triton grouped matmul over MXFP4-packed experts (SPEC §6, §7 "deployment weights: routed experts MXFP4"): each
program dequantises one [BN, BK] tile of its expert's packed weight in registers and multiplies it into one tile of
that expert's rows, so the weights cross memory at 4.25 bits each and are never expanded in memory.

Rows are sorted by expert (``counts`` rows each). The launch needs no host read: the M-tiles of every expert are laid
out on the device (``_tiles``), the grid holds their upper bound cdiv(M, BM) + E and surplus programs return at once.
Decoding is exact integer/bit arithmetic: E2M1 2x value = m (exponent field 0) or (2 + m) << e >> 1, the E8M0 scale
is the fp32 with exponent bits s (2^-127 for s = 0, NaN for s = 255). The pure-torch reference is
``k3.quant.packed.packed_grouped_mm_reference``; ``TRITON_INTERPRET=1`` runs this kernel on CPU tensors. The kernel
calls only Triton builtins (tl.full, not tl.zeros; join + reshape, not tl.interleave): the library's own jitted
helpers cannot run under the interpreter when triton was imported before TRITON_INTERPRET was set, as in a test
session.

Legend: M rows, K in features (a multiple of 32), N out features, E experts; BM/BN/BK tile sizes (BK a multiple
of 32).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _packed_grouped_mm_kernel(x_ptr, p_ptr, s_ptr, out_ptr, tile_expert_ptr, tile_start_ptr, tile_end_ptr, N,
                              stride_xm, stride_pe, stride_pn, stride_se, stride_sn, stride_om,
                              K: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                              FP32: tl.constexpr):
    t = tl.program_id(0)
    e = tl.load(tile_expert_ptr + t)
    if e >= 0:
        row0 = tl.load(tile_start_ptr + t)
        row1 = tl.load(tile_end_ptr + t)
        rows = row0 + tl.arange(0, BM)
        rmask = rows < row1
        cols = tl.program_id(1) * BN + tl.arange(0, BN)
        cmask = cols < N
        acc = tl.full((BM, BN), 0.0, tl.float32)
        for k0 in range(0, K, BK):
            a = tl.load(x_ptr + rows[:, None] * stride_xm + (k0 + tl.arange(0, BK))[None, :], mask=rmask[:, None],
                        other=0.0)
            byte = (k0 // 2 + tl.arange(0, BK // 2))[None, :]
            pk = tl.load(p_ptr + e * stride_pe + cols[:, None] * stride_pn + byte, mask=cmask[:, None], other=0)
            pk = pk.to(tl.int32)
            # [BN, BK]: element 2i is the low nibble of byte i (join + reshape is tl.interleave's body)
            code = tl.reshape(tl.join(pk & 0xF, pk >> 4), (BN, BK))
            ef, mf = (code >> 1) & 3, code & 1
            twice = tl.where(ef == 0, mf, ((2 + mf) << ef) >> 1)  # 2 x |value|, an integer in [0, 12]
            val = tl.where((code & 8) != 0, -twice, twice).to(tl.float32) * 0.5
            blk = (k0 // 32 + tl.arange(0, BK // 32))[None, :]
            s = tl.load(s_ptr + e * stride_se + cols[:, None] * stride_sn + blk, mask=cmask[:, None], other=127)
            s = s.to(tl.int32)
            bits = tl.where(s == 0, 1 << 22, tl.where(s == 255, 0x7FC00000, s << 23))
            scale = bits.to(tl.float32, bitcast=True)  # [BN, BK/32] = 2^(s - 127)
            w = tl.reshape(tl.reshape(val, (BN, BK // 32, 32)) * scale[:, :, None], (BN, BK))
            if FP32:
                acc = tl.dot(a, tl.trans(w), acc, input_precision="ieee")
            else:
                acc = tl.dot(a, tl.trans(w.to(a.dtype)), acc)
        out = out_ptr + rows[:, None] * stride_om + cols[None, :]
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=rmask[:, None] & cmask[None, :])


def _tiles(counts: torch.Tensor, bm: int, num_tiles: int):
    """counts [E] -> per tile t < num_tiles: its expert (-1 past the last tile), first row, end row (device ops)."""
    E = counts.shape[0]
    per = (counts + bm - 1) // bm
    last = per.cumsum(0)  # one past each expert's last tile
    t = torch.arange(num_tiles, device=counts.device)
    e = torch.searchsorted(last, t, right=True)
    ec = e.clamp(max=E - 1)
    row = counts.cumsum(0) - counts
    start = row[ec] + (t - (last - per)[ec]) * bm
    return torch.where(e < E, ec, -1), start, row[ec] + counts[ec]


def triton_packed_grouped_mm(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor,
                             counts: torch.Tensor) -> torch.Tensor:
    """x [M,K] sorted by expert, packed uint8 [E,N,K/2], scale uint8 [E,N,K/32], counts [E] -> [M,N] in x's dtype."""
    M, K = x.shape
    E, N = packed.shape[:2]
    x, packed, scale = x.contiguous(), packed.contiguous(), scale.contiguous()
    bm = 16 if M <= 16 * E else 64
    bn = 64 if N >= 64 else 32
    bk = 64 if K % 64 == 0 else 32
    num_tiles = triton.cdiv(M, bm) + E
    tile_e, tile_start, tile_end = _tiles(counts.to(torch.int64), bm, num_tiles)
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M == 0:
        return out
    grid = (num_tiles, triton.cdiv(N, bn))
    _packed_grouped_mm_kernel[grid](x, packed, scale, out, tile_e, tile_start, tile_end, N,
                                    x.stride(0), packed.stride(0), packed.stride(1), scale.stride(0), scale.stride(1),
                                    out.stride(0), K=K, BM=bm, BN=bn, BK=bk, FP32=x.dtype == torch.float32)
    return out
