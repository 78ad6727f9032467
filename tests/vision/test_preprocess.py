"""Native-resolution preprocessing (SPEC §10): a patch budget, the aspect ratio kept, sides padded to multiples of
28; bad images refused with errors that say what was wrong."""

import pytest
import torch
from PIL import Image

from k3.vision import VisionConfig
from k3.vision.preprocess import ImageError, fit_size, load_image, preprocess, read_image
from tests.vision.images import CORRUPT, png, png_header

V2 = VisionConfig.preset("moonvit-v2")


@pytest.mark.parametrize("size", [(30, 40), (1, 1), (28, 28), (29, 57), (1000, 3), (5000, 7000), (100_000, 20)])
def test_fit_keeps_aspect_respects_budget_pads_to_28(size):
    H, W = size
    (h, w), (ph, pw) = fit_size(H, W, V2, max_patches=16384, max_side=512)
    assert h <= H and w <= W  # never enlarged
    assert ph % 28 == 0 and pw % 28 == 0 and ph - h < 28 and pw - w < 28
    assert (ph // 14) * (pw // 14) <= 16384 and max(ph, pw) // 14 <= 512
    if (h, w) != (H, W):  # shrunk: the aspect ratio is kept (to the pixel), and only as far as the budget needs
        assert abs(h / w - H / W) <= max(1 / w, 1 / h) * (H / W + 1) + 1e-9
        big = fit_size(int(H * 1.05) + 1, int(W * 1.05) + 1, V2)[0]
        assert big[0] <= h * 1.1 + 2
    else:
        assert (ph // 14) * (pw // 14) <= 16384


def test_small_images_are_not_resized_only_padded():
    im = load_image(png(40, 30), V2)
    assert im.grid == (4, 4) and im.pixels.shape == (16, 3, 14, 14)  # 30 x 40 -> padded 56 x 56
    assert im.tokens(V2) == 4 and im.resized_from is None


def test_patches_are_the_image_row_major_normalised():
    g = torch.Generator().manual_seed(0)
    rgb = torch.randint(0, 256, (56, 84, 3), dtype=torch.uint8, generator=g)
    im = preprocess(Image.frombytes("RGB", (84, 56), bytes(rgb.flatten().tolist())), V2)
    assert im.grid == (4, 6)
    x = (rgb.permute(2, 0, 1).float() / 255 - 0.5) / 0.5  # [3,56,84]
    for k in (0, 5, 6, 23):
        r, c = divmod(k, 6)
        torch.testing.assert_close(im.pixels[k], x[:, 14 * r: 14 * r + 14, 14 * c: 14 * c + 14])


def test_padding_is_black_and_digest_names_content():
    a = load_image(png(20, 20, (255, 255, 255)), V2)
    assert a.grid == (2, 2)
    assert torch.all(a.pixels[3, :, -1, -1] == -1.0)  # bottom-right pixel: padding (black, normalised)
    assert torch.all(a.pixels[0, :, 0, 0] == 1.0)  # white
    assert load_image(png(20, 20, (255, 255, 255)), V2).digest == a.digest
    assert load_image(png(20, 20, (255, 255, 254)), V2).digest != a.digest


def test_large_image_is_fitted_to_the_budget():
    im = load_image(png(3000, 2000), V2, max_patches=1024)
    h, w = im.grid
    assert h * w <= 1024 and h % 2 == 0 and w % 2 == 0 and abs(w / h - 1.5) < 0.1
    assert im.resized_from == (2000, 3000)  # said, so a server can report it (k3.serve.images logs it)


@pytest.mark.parametrize("data, match", [
    (b"", "empty \\(0 bytes\\)"),
    (CORRUPT, "not an image k3 can read"),
    (png_header(0, 5), "zero size \\(0 x 5 pixels\\)"),
    (png_header(10_000, 10_000), "10000 x 10000 = 100.0 megapixels, more than the limit of 50"),
    (png_header(20_000, 20_000), "megapixels"),
    (png(64, 64)[:-40], "could not be decoded|not an image"),
])
def test_bad_images_are_refused_with_what_was_wrong(data, match):
    with pytest.raises(ImageError, match=match) as e:
        read_image(data, name="the test image")
    assert str(e.value).startswith("the test image ") and "BytesIO" not in str(e.value) \
        and "object at 0x" not in str(e.value)
    if data is CORRUPT:  # what the bytes are instead: their count and first bytes
        assert f"{len(CORRUPT)} bytes" in str(e.value) and CORRUPT[:8].hex(" ") in str(e.value)


def test_missing_file_names_the_path(tmp_path):
    with pytest.raises(ImageError, match="cannot read the file"):
        read_image(tmp_path / "nope.png", name=str(tmp_path / "nope.png"))
