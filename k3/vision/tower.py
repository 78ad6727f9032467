"""MoonViT: the vision tower (SPEC §10), K3's MoonViT-V2 and Kimi K2.5's MoonViT by ``VisionConfig``.

Legend: T packed patches (all images), N images, h x w an image's grid in patches, D width, H heads, Dh head dim,
p patch size, M = merge kernel area (2 x 2 = 4).

    pixels [T,3,p,p] --Conv2d(3,D,p,p)--> [T,D] + position grid resampled to each image's h x w
      --> 27 x pre-norm layers: x + Wo attend_within_image(rope2d(q), rope2d(k), v);  x + fc1 gelu(fc0 x)
      --> final norm --> 2x2 merge: [T/M, M, D] (each image's 2 x 2 neighbourhoods, row-major)

- Native resolution: images keep their aspect ratio; each contributes h*w patches to one packed sequence and
  attention never crosses images (``attend_images``).
- Position: a learned [H0, W0, D] grid resampled to each image's grid (bilinear for V2, bicubic for K2.5, as
  ``F.interpolate`` with ``align_corners=False``), added once; and 2-D RoPE on q and k in every layer: the head dim's
  complex pairs alternate between the column (x) and row (y) position, pair 2i rotating by x * theta^(-4i/Dh) and
  pair 2i+1 by y * theta^(-4i/Dh) (the release's interleaved layout: ``wqkv`` needs no permutation).
- Module and parameter names are the release's (``patch_embed.proj``, ``patch_embed.pos_emb.weight``,
  ``encoder.blocks.N.{norm0, wqkv, wo, norm1, mlp.fc0, mlp.fc1}``, ``encoder.final_layernorm``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from .attention import attend_images
from .config import VisionConfig

__all__ = ["MoonViT", "merge_patches", "rope_2d", "grid_cu_seqlens"]

MAX_GRID = 512  # RoPE positions per side (the release's table: 512 x 512 patches)


def _norm(cfg: VisionConfig, dim: int) -> nn.Module:
    # the release's RMSNorm takes torch's default eps (the dtype's machine epsilon); its LayerNorm 1e-5
    return nn.RMSNorm(dim) if cfg.norm_type == "rmsnorm" else nn.LayerNorm(dim, eps=1e-5)


def grid_cu_seqlens(grids: Sequence[tuple[int, int]], device=None) -> torch.Tensor:
    """[N+1] int64 boundaries of each image's h*w patches in the packed sequence."""
    sizes = torch.tensor([0] + [h * w for h, w in grids], dtype=torch.long)
    return sizes.cumsum(0).to(device)


def rope_2d(grids: Sequence[tuple[int, int]], head_dim: int, theta: float, device=None) -> tuple[torch.Tensor, ...]:
    """(cos, sin) [T, Dh/2] fp32: the rotation of every complex pair of every patch (row-major within each image)."""
    inv = theta ** (-torch.arange(0, head_dim, 4, dtype=torch.float32)[: head_dim // 4] / head_dim)  # [Dh/4]
    angles = []
    for h, w in grids:
        if not (1 <= h <= MAX_GRID and 1 <= w <= MAX_GRID):
            raise ValueError(f"an image grid of {h} x {w} patches is outside MoonViT's RoPE table ({MAX_GRID} x "
                             f"{MAX_GRID}); resize the image to at most {MAX_GRID} patches per side")
        y, x = torch.meshgrid(torch.arange(h, dtype=torch.float32), torch.arange(w, dtype=torch.float32),
                              indexing="ij")
        a = torch.stack([x.reshape(-1, 1) * inv, y.reshape(-1, 1) * inv], dim=-1)  # [hw, Dh/4, 2]: x, y alternate
        angles.append(a.reshape(h * w, head_dim // 2))
    a = torch.cat(angles).to(device)
    return a.cos(), a.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T,H,Dh] with interleaved pairs (x[2j], x[2j+1]) rotated by cos/sin [T,Dh/2]; computed in fp32."""
    xf = x.float().unflatten(-1, (-1, 2))  # [T,H,Dh/2,2]
    a, b = xf[..., 0], xf[..., 1]
    c, s = cos[:, None], sin[:, None]
    return torch.stack([a * c - b * s, a * s + b * c], dim=-1).flatten(-2).to(x.dtype)


def merge_patches(x: torch.Tensor, grids: Sequence[tuple[int, int]], kernel: tuple[int, int]) -> torch.Tensor:
    """[T,D] packed patches -> [T/M, M, D]: every image's kh x kw neighbourhoods, row-major over the merged grid,
    each neighbourhood's patches row-major (what the projector flattens into one token)."""
    kh, kw = kernel
    out, start = [], 0
    for h, w in grids:
        if h % kh or w % kw:
            raise ValueError(f"an image grid of {h} x {w} patches does not divide into {kh} x {kw} merge windows; "
                             f"pad images to multiples of {kh} x {kw} patches (k3.vision.preprocess does)")
        img = x[start: start + h * w].view(h // kh, kh, w // kw, kw, -1)
        out.append(img.permute(0, 2, 1, 3, 4).reshape((h // kh) * (w // kw), kh * kw, -1))
        start += h * w
    return torch.cat(out)


class PositionGrid(nn.Module):
    """The learned [H0, W0, D] position grid (``pos_emb.weight``), resampled to each image's grid."""

    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(cfg.init_pos_emb_height, cfg.init_pos_emb_width, cfg.vt_hidden_size))
        self.mode = cfg.pos_emb_interpolation_mode

    def forward(self, grids: Sequence[tuple[int, int]]) -> torch.Tensor:
        """[T,D]: the grid at every patch of every image."""
        out = []
        for h, w in grids:
            if (h, w) == tuple(self.weight.shape[:2]):
                out.append(self.weight.flatten(0, 1))
            else:
                g = F.interpolate(self.weight.permute(2, 0, 1)[None], size=(h, w), mode=self.mode, align_corners=False)
                out.append(g[0].permute(1, 2, 0).flatten(0, 1))
        return torch.cat(out)


class PatchEmbed(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        p = cfg.patch_size
        self.proj = nn.Conv2d(3, cfg.vt_hidden_size, kernel_size=p, stride=p, bias=cfg.patch_embed_proj_bias)
        self.pos_emb = PositionGrid(cfg)

    def forward(self, pixels: torch.Tensor, grids) -> torch.Tensor:
        """pixels [T,3,p,p] -> [T,D]."""
        x = self.proj(pixels.to(self.proj.weight.dtype)).flatten(1)
        return x + self.pos_emb(grids).to(x.dtype)


class MLP2(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.fc0 = nn.Linear(cfg.vt_hidden_size, cfg.vt_intermediate_size, bias=cfg.linear_bias)
        self.fc1 = nn.Linear(cfg.vt_intermediate_size, cfg.vt_hidden_size, bias=cfg.linear_bias)
        self.approximate = "tanh" if cfg.activation_func == "gelu_pytorch_tanh" else "none"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc1(F.gelu(self.fc0(x), approximate=self.approximate))


class EncoderLayer(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.heads, self.head_dim = cfg.vt_num_attention_heads, cfg.head_dim
        self.norm0 = _norm(cfg, cfg.vt_hidden_size)
        self.wqkv = nn.Linear(cfg.vt_hidden_size, 3 * cfg.attention_width, bias=cfg.attn_bias)
        self.wo = nn.Linear(cfg.attention_width, cfg.vt_hidden_size, bias=cfg.attn_bias)
        self.norm1 = _norm(cfg, cfg.vt_hidden_size)
        self.mlp = MLP2(cfg)

    def qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """x [T,D] -> q, k, v [T,H,Dh] (q and k rotated): row by row, so any rows may be computed apart."""
        T = x.shape[0]
        q, k, v = self.wqkv(self.norm0(x)).view(T, 3, self.heads, self.head_dim).unbind(1)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def out(self, x: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
        """The rows x [T,D] with their attention output o [T,H,Dh] -> the layer's output rows (row by row)."""
        x = x + self.wo(o.reshape(x.shape[0], -1))
        return x + self.mlp(self.norm1(x))

    def forward(self, x: torch.Tensor, cu_seqlens: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return self.out(x, attend_images(*self.qkv(x, cos, sin), cu_seqlens))


class Encoder(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.blocks = nn.ModuleList(EncoderLayer(cfg) for _ in range(cfg.vt_num_hidden_layers))
        self.final_layernorm = _norm(cfg, cfg.vt_hidden_size)


class MoonViT(nn.Module):
    """pixels [T,3,p,p] of N images with ``grids`` [(h, w)] -> merged patches [T/M, M, D] (image after image)."""

    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.config = cfg
        self.patch_embed = PatchEmbed(cfg)
        self.encoder = Encoder(cfg)
        self.gradient_checkpointing = False

    def forward(self, pixels: torch.Tensor, grids: Sequence[tuple[int, int]]) -> torch.Tensor:
        grids = [(int(h), int(w)) for h, w in grids]
        T = sum(h * w for h, w in grids)
        if pixels.dim() != 4 or pixels.shape[0] != T:
            raise ValueError(f"pixels must be [patches, 3, p, p] with one row per patch of the grids {grids} "
                             f"({T} patches); got shape {tuple(pixels.shape)}")
        x = self.patch_embed(pixels, grids)
        cu = grid_cu_seqlens(grids, x.device)
        cos, sin = rope_2d(grids, self.config.head_dim, self.config.rope_theta, x.device)
        for block in self.encoder.blocks:
            if self.gradient_checkpointing and self.training:
                from torch.utils.checkpoint import checkpoint

                x = checkpoint(block, x, cu, cos, sin, use_reentrant=False)
            else:
                x = block(x, cu, cos, sin)
        return merge_patches(self.encoder.final_layernorm(x), grids, self.config.merge_kernel_size)
