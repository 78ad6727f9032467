"""One image through the tower and the projector in bounded pieces, for a server that must keep serving while it
encodes (SPEC §7, §10): the engine runs a few pieces per step, so a 16384-patch image never holds a step for the
whole tower.

Legend: T the image's patches, D the tower's width, A its attention width, I its MLP width, p the patch size, M the
merge area, E the LM's width, C the rows of one piece.

Every stage of the tower is row-wise except attention, whose rows need every row's keys and values of the same
layer. So each layer is two passes over the rows: (1) q, k, v of C rows at a time (``EncoderLayer.qkv``); (2) C
query rows against all T keys (``attend_rows``), then wo and the MLP on those rows (``EncoderLayer.out``). The
patch embedding and the projector are row-wise too. A piece is C rows of one pass, C chosen so that the piece costs
about ``piece_flops``:

    embed   2 * 3p^2 * D                       per row
    qkv     2 * D * 3A
    attend  4 * T * A + 2 * A * D + 4 * D * I   (q k^T and p v over T keys, wo, the MLP)
    project 2 * MD * (MD + E)                   per merged token

The result equals ``K3ForConditionalGeneration.encode_images`` of the image (the same modules on the same rows; only
the matmuls' blocking differs).
"""

from __future__ import annotations

from collections.abc import Generator

import torch

from .attention import attend_rows
from .tower import MoonViT, merge_patches, rope_2d

__all__ = ["encode_in_pieces"]


def _costs(tower: MoonViT, projector, T: int) -> dict[str, float]:
    c = tower.config
    A, D, I, MD = c.attention_width, c.vt_hidden_size, c.vt_intermediate_size, c.merge * c.vt_hidden_size
    E = projector.proj[2].out_features
    return {"embed": 2 * 3 * c.patch_size ** 2 * D, "qkv": 2 * D * 3 * A, "attend": 4 * T * A + 2 * A * D + 4 * D * I,
            "project": 2 * MD * (MD + E)}


def _rows(total: int, per_row: float, piece_flops: float) -> int:
    return max(1, min(total, int(piece_flops // per_row)))


def encode_in_pieces(tower: MoonViT, projector, pixels: torch.Tensor, grid: tuple[int, int],
                     piece_flops: float) -> Generator[float, None, torch.Tensor]:
    """Encode one image (pixels [h*w,3,p,p], ``grid`` (h, w)) piece by piece: each ``next`` runs one piece and
    yields its FLOPs; the generator returns the image's token embeddings [h*w/M, E]. Run it under ``no_grad``."""
    cfg = tower.config
    h, w = int(grid[0]), int(grid[1])
    T = h * w
    if pixels.dim() != 4 or pixels.shape[0] != T:
        raise ValueError(f"pixels must be [patches, 3, p, p] with one row per patch of the grid {(h, w)} ({T} "
                         f"patches); got shape {tuple(pixels.shape)}")
    f = _costs(tower, projector, T)
    embed = tower.patch_embed
    dtype = embed.proj.weight.dtype
    pos = embed.pos_emb([(h, w)])
    x = torch.empty(T, cfg.vt_hidden_size, dtype=dtype, device=pixels.device)
    C = _rows(T, f["embed"], piece_flops)
    for a in range(0, T, C):
        x[a: a + C] = embed.proj(pixels[a: a + C].to(dtype)).flatten(1) + pos[a: a + C].to(dtype)
        yield f["embed"] * min(C, T - a)
    cos, sin = rope_2d([(h, w)], cfg.head_dim, cfg.rope_theta, x.device)
    shape = (T, cfg.vt_num_attention_heads, cfg.head_dim)
    for block in tower.encoder.blocks:
        q, k, v = (torch.empty(shape, dtype=dtype, device=x.device) for _ in range(3))
        C = _rows(T, f["qkv"], piece_flops)
        for a in range(0, T, C):
            q[a: a + C], k[a: a + C], v[a: a + C] = block.qkv(x[a: a + C], cos[a: a + C], sin[a: a + C])
            yield f["qkv"] * min(C, T - a)
        k4, v4 = k.transpose(0, 1)[None], v.transpose(0, 1)[None]  # [1,H,T,Dh]
        C = _rows(T, f["attend"], piece_flops)
        for a in range(0, T, C):  # rows a:a+C read only k, v (done) and their own x: updated in place
            o = attend_rows(q[a: a + C].transpose(0, 1)[None], k4, v4)[0].transpose(0, 1)
            x[a: a + C] = block.out(x[a: a + C], o)
            yield f["attend"] * min(C, T - a)
        del q, k, v, k4, v4
    merged = merge_patches(tower.encoder.final_layernorm(x), [(h, w)], cfg.merge_kernel_size)  # [T/M, M, D]
    del x
    n = merged.shape[0]
    C = _rows(n, f["project"], piece_flops)
    parts = []
    for a in range(0, n, C):
        parts.append(projector(merged[a: a + C]))
        yield f["project"] * min(C, n - a)
    return torch.cat(parts)
