"""Image bytes for the tests: valid PNGs, and the bad ones a server must refuse; and a model's own greedy reply to
chat messages with images (what chat and serve must reproduce)."""

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


def greedy_reply(model, tok, messages, n: int = 4) -> tuple[str, int]:
    """(the text of ``model``'s ``n`` greedy tokens after ``messages`` in ChatML, the prompt's length), by full
    forwards of K3ForConditionalGeneration (no engine, no cache)."""
    import torch

    from k3.chat import ChatTemplate
    from k3.vision.chat import encode_chat

    out = encode_chat(ChatTemplate(), tok, messages, model.vision_config, model.media_placeholder_token_id)
    pixels, grids = out.packed()
    ids, new = list(out.ids), []
    with torch.no_grad():
        for _ in range(n):
            new.append(int(model(torch.tensor([ids]), pixels, grids).logits[0, -1].argmax()))
            ids.append(new[-1])
    return tok.decode(new, skip_special_tokens=False), len(out.ids)
