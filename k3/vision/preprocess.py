"""Images in: bytes or a file -> checked, decoded (Pillow) -> native-resolution patches for the tower (SPEC §10).

Legend: H x W pixels, p the patch size, h x w the grid in patches (h = H/p after padding), u = p x merge = 28.

- Read (``read_image``): refused with an ``ImageError`` that says what was wrong and what to do when the bytes are
  empty, not an image Pillow can decode, truncated, zero-sized, or larger than ``max_pixels`` (checked from the
  header, before anything is decoded, so a 100-megapixel or decompression-bomb file costs nothing).
- Fit (``fit_size``): no resizing to a square. An image is shrunk (keeping its aspect ratio, bicubic) only when its
  patch grid exceeds the budget: at most ``max_patches`` patches in all and ``max_side`` per side (the RoPE table);
  it is never enlarged. Then it is padded right and bottom with black to multiples of u = 28 pixels, so its grid
  divides into 2 x 2 merge windows.
- Pixels: RGB in [0, 1] normalised with mean 0.5 and std 0.5 (K2.5's processor; padding is black before
  normalising, as there), cut into h*w patches [h*w, 3, p, p] row-major.
- ``digest``: a hash of the fitted RGB pixels and the grid, naming the image's content for the prefix cache.
"""

from __future__ import annotations

import hashlib
import io
import math
import struct
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from .config import VisionConfig

__all__ = ["ImageError", "ImageInput", "read_image", "fit_size", "preprocess", "load_image", "pack_images",
           "MAX_PIXELS", "MAX_PATCHES"]

MAX_PIXELS = 50_000_000  # decoded size refused beyond this (a 7071 x 7071 image); a 100-megapixel image is refused
MAX_PATCHES = 16384  # the patch budget of K2.5's processor (4096 image tokens after the 2 x 2 merge)
MEAN = STD = 0.5


class ImageError(ValueError):
    """An image k3 cannot use; the message says what was wrong and what to do; ``param`` names the request field
    it came from, when it came from one (``messages[0].content[1]``)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class ImageInput:
    """One preprocessed image: ``pixels`` [h*w, 3, p, p] fp32, ``grid`` (h, w) in patches, ``digest`` (16 bytes),
    ``resized_from``: its size before it was shrunk to the patch budget (None when it was not)."""

    pixels: torch.Tensor
    grid: tuple[int, int]
    digest: bytes
    resized_from: tuple[int, int] | None = None  # (H, W) pixels before ``fit_size`` shrank it; None: not shrunk

    def tokens(self, cfg: VisionConfig) -> int:
        """Placeholder tokens it takes in the prompt (h*w / 4)."""
        return self.grid[0] * self.grid[1] // cfg.merge


def _png_size(data: bytes) -> tuple[int, int] | None:
    if data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR" and len(data) >= 24:
        return struct.unpack(">II", data[16:24])
    return None


def read_image(source: bytes | str | Path, *, max_pixels: int = MAX_PIXELS, name: str = "image"):
    """A Pillow RGB image from bytes or a file path; ``name`` says which image in errors (a file, a request field)."""
    from PIL import Image, UnidentifiedImageError

    if isinstance(source, (str, Path)):
        try:
            data = Path(source).read_bytes()
        except OSError as e:
            raise ImageError(f"{name}: cannot read the file ({e.strerror or e})") from None
    else:
        data = bytes(source)
    if not data:
        raise ImageError(f"{name} is empty (0 bytes); send the bytes of a PNG, JPEG, GIF, WebP or BMP image")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)  # our own limit, below, decides
        buffer = io.BytesIO(data)
        try:
            im = Image.open(buffer)
        except Image.DecompressionBombError as e:
            raise ImageError(f"{name} is too large to decode ({_detail(e, buffer)}); downscale it to at most "
                             f"{max_pixels / 1e6:g} megapixels") from None
        except (UnidentifiedImageError, OSError) as e:
            size = _png_size(data)
            if size is not None and 0 in size:
                raise ImageError(f"{name} has zero size ({size[0]} x {size[1]} pixels); send an image with pixels in "
                                 "it") from None
            why = (f"Pillow recognises no image format in them; they begin {data[:8].hex(' ')}"
                   if isinstance(e, UnidentifiedImageError) else _detail(e, buffer))
            raise ImageError(f"{name} is not an image k3 can read ({len(data)} bytes; {why}); send PNG, JPEG, GIF, "
                             "WebP or BMP bytes") from None
    w, h = im.size
    if w == 0 or h == 0:
        raise ImageError(f"{name} has zero size ({w} x {h} pixels); send an image with pixels in it")
    if w * h > max_pixels:
        raise ImageError(f"{name} is {w} x {h} = {w * h / 1e6:.1f} megapixels, more than the limit of "
                         f"{max_pixels / 1e6:g}; downscale it first (the vision tower sees at most {MAX_PATCHES} "
                         "patches of 14 x 14 pixels anyway)")
    try:
        im.load()
        return im.convert("RGB")
    except (OSError, ValueError, SyntaxError) as e:  # truncated or corrupt pixel data
        raise ImageError(f"{name} could not be decoded: its data is truncated or corrupt "
                         f"({_detail(e, buffer)})") from None


def _detail(e: Exception, buffer: io.BytesIO) -> str:
    """Pillow's message without the repr of the in-memory file it read (``<_io.BytesIO object at 0x...>``)."""
    return str(e).replace(f" {buffer!r}", "").replace(repr(buffer), "the image") or type(e).__name__


def fit_size(height: int, width: int, cfg: VisionConfig, max_patches: int = MAX_PATCHES,
             max_side: int = 512) -> tuple[tuple[int, int], tuple[int, int]]:
    """((resized H, W), (padded H, W)): the largest size at most the original, aspect kept, whose padded grid has at
    most ``max_patches`` patches and ``max_side`` per side."""
    p, u = cfg.patch_size, cfg.unit
    if max_patches < cfg.merge or max_side * p < u:
        raise ValueError(f"max_patches ({max_patches}) / max_side ({max_side}) leave no room for one image token")

    def padded(n: int) -> int:
        return -(-n // u) * u

    scale = min(1.0, max_side * p / height, max_side * p / width,
                math.sqrt(max_patches / max(1.0, (height / p) * (width / p))))
    while True:
        h, w = max(1, int(height * scale)), max(1, int(width * scale))
        ph, pw = padded(h), padded(w)
        if (ph // p) * (pw // p) <= max_patches and max(ph, pw) // p <= max_side:
            return (h, w), (ph, pw)
        scale *= 0.99  # the padding pushed it over the budget: shrink a little more


def preprocess(image, cfg: VisionConfig, max_patches: int = MAX_PATCHES) -> ImageInput:
    """A Pillow RGB image -> its patches, grid and digest (see the module docstring)."""
    from PIL import Image

    W, H = image.size
    (h, w), (ph, pw) = fit_size(H, W, cfg, max_patches)
    if (h, w) != (H, W):
        image = image.resize((w, h), Image.Resampling.BICUBIC)
    rgb = image.tobytes()
    arr = torch.frombuffer(bytearray(rgb), dtype=torch.uint8).view(h, w, 3).permute(2, 0, 1)  # [3,h,w]
    x = torch.zeros(3, ph, pw, dtype=torch.float32)
    x[:, :h, :w] = arr.float() / 255.0
    x = (x - MEAN) / STD
    p = cfg.patch_size
    gh, gw = ph // p, pw // p
    pixels = x.view(3, gh, p, gw, p).permute(1, 3, 0, 2, 4).reshape(gh * gw, 3, p, p).contiguous()
    digest = hashlib.blake2b(struct.pack("<qqqq", h, w, gh, gw) + rgb, digest_size=16).digest()
    return ImageInput(pixels, (gh, gw), digest, (H, W) if (h, w) != (H, W) else None)


def load_image(source: bytes | str | Path, cfg: VisionConfig, *, max_pixels: int = MAX_PIXELS,
               max_patches: int = MAX_PATCHES, name: str = "image") -> ImageInput:
    """``read_image`` then ``preprocess``."""
    return preprocess(read_image(source, max_pixels=max_pixels, name=name), cfg, max_patches)


def pack_images(images: list[ImageInput]) -> tuple[torch.Tensor | None, list[tuple[int, int]]]:
    """Several images -> one packed patch sequence for the tower: (pixels [sum h*w, 3, p, p], grids)."""
    if not images:
        return None, []
    return torch.cat([im.pixels for im in images]), [im.grid for im in images]
