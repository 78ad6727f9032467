"""Rendered scenes for training the vision path with no download (``k3 demo-vision``): a coloured shape and a digit,
drawn with Pillow, and questions about them whose answers only the image holds.

A scene is 56 x 84 pixels (a 4 x 6 patch grid: 6 image tokens after the 2 x 2 merge): on a dark background with
noise, a circle, square or triangle in red, green, blue or yellow, of random size and place in the left 56 x 56, and
a white digit 0-9 in the right 28 x 56. Each scene answers three questions (``QUESTIONS``); a model that ignores the
image can do no better than the answers' prior (a third, a quarter and a tenth right).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from functools import lru_cache

__all__ = ["Scene", "SHAPES", "COLOURS", "QUESTIONS", "random_scene", "render"]

SHAPES = ("circle", "square", "triangle")
COLOURS = {"red": (225, 45, 45), "green": (45, 185, 70), "blue": (60, 90, 235), "yellow": (235, 205, 40)}
QUESTIONS = {"shape": "What shape is in the picture?", "colour": "What colour is the shape?",
             "digit": "Which digit is written?"}
HEIGHT, WIDTH = 56, 84
_DARK = bytes(b * 48 // 256 for b in range(256))  # uniform bytes -> background noise in [0, 48)


@dataclass(frozen=True)
class Scene:
    shape: str
    colour: str
    digit: int
    cx: int  # the shape's centre and half-size, in pixels
    cy: int
    r: int
    noise_seed: int

    def answer(self, question: str) -> str:
        return {"shape": self.shape, "colour": self.colour, "digit": str(self.digit)}[question]


def random_scene(rng: random.Random) -> Scene:
    r = rng.randint(9, 17)
    return Scene(rng.choice(SHAPES), rng.choice(list(COLOURS)), rng.randrange(10), rng.randint(r + 2, 54 - r),
                 rng.randint(r + 2, 54 - r), r, rng.randrange(2**31))


@lru_cache(maxsize=1)
def _font():
    from PIL import ImageFont

    try:
        return ImageFont.load_default(size=34)
    except (OSError, ImportError, TypeError):  # a Pillow without FreeType: the bitmap font, drawn small
        return ImageFont.load_default()


def render(scene: Scene):
    """The scene as an RGB Pillow image, HEIGHT x WIDTH."""
    from PIL import Image, ImageDraw

    noise = random.Random(scene.noise_seed).randbytes(WIDTH * HEIGHT * 3).translate(_DARK)
    im = Image.frombytes("RGB", (WIDTH, HEIGHT), noise)
    draw = ImageDraw.Draw(im)
    c, (x, y, r) = COLOURS[scene.colour], (scene.cx, scene.cy, scene.r)
    if scene.shape == "circle":
        draw.ellipse((x - r, y - r, x + r, y + r), fill=c)
    elif scene.shape == "square":
        draw.rectangle((x - r, y - r, x + r, y + r), fill=c)
    else:
        draw.polygon([(x, y - r), (x - r, y + r), (x + r, y + r)], fill=c)
    draw.text((70, 28), str(scene.digit), fill=(255, 255, 255), font=_font(), anchor="mm")
    return im
