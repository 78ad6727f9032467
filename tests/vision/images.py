"""Image bytes for the tests: valid PNGs, and the bad ones a server must refuse."""

import io
import struct
import zlib

from PIL import Image


def png(width=40, height=30, color=(200, 30, 30)) -> bytes:
    b = io.BytesIO()
    Image.new("RGB", (width, height), color).save(b, "PNG")
    return b.getvalue()


def png_header(width: int, height: int) -> bytes:
    """A small PNG whose header claims ``width`` x ``height`` (its pixel data is that of a 4 x 4 image)."""
    d = png(4, 4)
    body = b"IHDR" + struct.pack(">II", width, height) + d[24:29]
    return d[:8] + struct.pack(">I", 13) + body + struct.pack(">I", zlib.crc32(body)) + d[33:]


CORRUPT = b"\x89PNG\r\n\x1a\n this is not an image at all"
