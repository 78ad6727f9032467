"""``k3 chat --image PATH`` (repeatable) on a multimodal checkpoint: the first reply is the model's greedy reply to the
first message with the images before its text, the images stay in the conversation; a text-only checkpoint and a
bad file are refused at start with the option named."""

import io

import pytest
import torch

from k3 import K3Config, K3ForCausalLM
from k3.pretrained import save_pretrained
from k3.cli import build_parser, chat, main
from k3.inference.load import load_for_inference
from k3.data.tokenizer import save_tokenizer, train_tokenizer
from k3.vision import K3ForConditionalGeneration, VisionConfig
from tests.vision.images import CORRUPT, greedy_reply, png


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    tok = train_tokenizer(["what colour is the square?", "a red square"] * 20, 300,
                          special_tokens=("<|endoftext|>", "<|media_pad|>"))
    cfg = K3Config.preset("tiny").replace(vocab_size=tok.get_vocab_size(), num_nextn_predict_layers=0)
    torch.manual_seed(0)
    vl, text = tmp_path_factory.mktemp("vl"), tmp_path_factory.mktemp("text")
    save_pretrained(K3ForConditionalGeneration(cfg, VisionConfig.preset("tiny"), tok.token_to_id("<|media_pad|>")), vl)
    save_pretrained(K3ForCausalLM(cfg), text)
    for d in (vl, text):
        save_tokenizer(tok, d / "tokenizer.json")
    images = tmp_path_factory.mktemp("img")
    (images / "red.png").write_bytes(png(40, 30, (220, 20, 20)))
    (images / "wide.png").write_bytes(png(90, 20, (20, 220, 20)))
    (images / "bad.png").write_bytes(CORRUPT)
    return vl, text, images


def chat_args(ck, *images):
    argv = ["chat", "--checkpoint", str(ck), "--max-tokens", "4", "--temperature", "0", "--device", "cpu"]
    return build_parser().parse_args(argv + [a for im in images for a in ("--image", str(im))])




def test_images_go_with_the_first_message(checkpoints):
    vl, _, img = checkpoints
    out = io.StringIO()
    assert chat.run(chat_args(vl, img / "red.png", img / "wide.png"), stdin=io.StringIO("what colour?\nand now?\n\n"),
                    stdout=out) == 0
    replies = out.getvalue().split("> ")[1:3]
    model, tok = load_for_inference(vl, "cpu")
    first = [{"role": "user", "content": [{"type": "image", "path": str(img / "red.png")},
                                          {"type": "image", "path": str(img / "wide.png")},
                                          {"type": "text", "text": "what colour?"}]}]
    assert replies[0] == greedy_reply(model, tok, first)[0] + "\n"
    second = first + [{"role": "assistant", "content": replies[0][:-1]}, {"role": "user", "content": "and now?"}]
    assert replies[1] == greedy_reply(model, tok, second)[0] + "\n"
    assert replies[0] != greedy_reply(model, tok, [{"role": "user", "content": "what colour?"}])[0] + "\n"


def test_refused_at_start_with_the_option_named(checkpoints, capsys):
    vl, text, img = checkpoints
    base = ["chat", "--max-tokens", "2", "--device", "cpu"]
    assert main(base + ["--checkpoint", str(text), "--image", str(img / "red.png")]) == 1
    assert "--image: this checkpoint has no vision tower" in capsys.readouterr().err
    assert main(base + ["--checkpoint", str(vl), "--image", str(img / "bad.png")]) == 1
    assert f"--image {img / 'bad.png'} is not an image k3 can read" in capsys.readouterr().err
    assert main(base + ["--checkpoint", str(vl), "--image", str(img / "missing.png")]) == 1
    assert "cannot read the file" in capsys.readouterr().err
