"""``k3 demo-vision`` at CI size: the rendered scenes hold their answers, a short run on one question learns to read
the image (held-out answers: lower loss and higher accuracy with the image than with another scene's image, above
the answers' prior), and what it saves is a multimodal checkpoint that ``k3 chat --image`` loads."""

import json
import random

import pytest
import torch

from k3.cli import main
from k3.cli.demo_vision import SceneTask, answer_stats
from k3.pretrained import load_pretrained
from k3.vision import VisionConfig
from k3.vision.shapes import COLOURS, HEIGHT, WIDTH, Scene, render


def test_scenes_show_their_shape_colour_and_digit():
    s = Scene("square", "blue", 7, cx=20, cy=30, r=10, noise_seed=1)
    im = render(s)
    assert im.size == (WIDTH, HEIGHT)
    assert im.getpixel((20, 30)) == COLOURS["blue"] and im.getpixel((11, 21)) == COLOURS["blue"]
    assert max(im.getpixel((5, 5))) < 48  # background noise
    assert render(s.__class__(**{**s.__dict__, "digit": 1})).tobytes() != im.tobytes()  # the digit is drawn
    task = SceneTask(VisionConfig.preset("tiny"))
    ex = task.batch([s, s], ["colour", "digit"])
    assert ex.grids == [(4, 6), (4, 6)] and ex.pixels.shape == (48, 3, 14, 14)
    answers = [task.tok.decode([t for t in row if t != -100]) for row in ex.labels.tolist()]
    assert answers == ["blue<|im_end|>", "7<|im_end|>"]
    assert (ex.ids == task.placeholder).sum(1).tolist() == [6, 6]  # one image of 4 x 6 patches each


@pytest.mark.slow
def test_a_short_run_reads_the_image(tmp_path, capsys):
    out = tmp_path / "dv"
    assert main(["demo-vision", "--steps", "60", "--batch-size", "16", "--vision-after", "60", "--questions", "colour",
                 "--val-scenes", "48", "--out", str(out)]) == 0
    r = json.loads((out / "results.json").read_text())
    assert r["val_questions"] == 48 and r["questions"] == ["colour"]
    assert r["val_loss_image"] < 0.85 * r["val_loss_shuffled"], r  # (the answers end in <|im_end|>, read without it)
    assert r["accuracy_image"] > max(0.5, r["accuracy_shuffled"] + 0.3), r  # chance (and the prior): 25%
    printed = capsys.readouterr().out
    assert f"{r['val_loss_image']:.3f} with the image, {r['val_loss_shuffled']:.3f} with a shuffled image" in printed
    model = load_pretrained(out, vision=True)  # what `k3 chat --image` loads
    task = SceneTask(VisionConfig.preset("tiny"))
    rng = random.Random(123)
    scenes = [task._scene(rng) for _ in range(24)]
    ex = task.batch(scenes, ["colour"] * 24)
    with torch.no_grad():
        loss, right = answer_stats(model.eval(), ex)
    assert right.float().mean() > 0.5  # the reloaded model still answers from the image


@pytest.mark.slow
def test_the_sft_variant_writes_chat_data_with_images_and_scores_it(tmp_path, capsys):
    """``--sft``'s plumbing at a few steps (what it measures at full size is in benchmarks/RESULTS.md)."""
    out = tmp_path / "dvs"
    assert main(["demo-vision", "--sft", "--steps", "3", "--batch-size", "8", "--val-scenes", "4", "--out",
                 str(out)]) == 0
    train = [json.loads(line) for line in (out / "data" / "train.jsonl").read_text().splitlines()]
    assert len(train) == 24 and train[0]["messages"][0]["content"][0]["image_url"]["url"].startswith("data:image/png")
    r = json.loads((out / "results.json").read_text())
    assert r["via"] == "k3 sft" and r["val_questions"] == 12 and r["train_scenes"] == 24
    assert f"{r['val_loss_image']:.3f} with the image" in capsys.readouterr().out
    assert load_pretrained(out / "sft" / "checkpoint", vision=True).vision_config == \
        VisionConfig.preset("tiny")
