"""Chat messages with image parts -> prompt ids with each image's placeholder run in place, and the images (SPEC §10):
the text around an image tokenizes as the chat format tokenizes it without the image; every format (ChatML, K3's,
Kimi's media markers) puts the run where the part was; bad parts are refused naming the part; the result trains
(SFT) and matches a hand-built prompt."""

import pytest
import torch

from k3 import K3Config
from k3.data.kimi_tokenizer import KimiTokenizer
from k3.data.tokenizer import train_tokenizer
from k3.chat import ChatTemplate, chat_template_for
from k3.vision import K3ForConditionalGeneration, VisionConfig
from k3.vision.chat import data_url, encode_chat, has_images
from k3.vision.preprocess import ImageError, load_image
from tests.data.kimi_files import K2_TEMPLATE, write_kimi_tokenizer
from tests.vision.images import CORRUPT, png, png_header

TINY = VisionConfig.preset("tiny")
MEDIA = ("<|endoftext|>", "<|media_pad|>", "<|media_begin|>", "<|media_content|>", "<|media_end|>")


@pytest.fixture(scope="module")
def tok():
    return train_tokenizer(["what colour is the square?", "a red square", "two images"] * 20, 300,
                           special_tokens=("<|endoftext|>", "<|media_pad|>"))


@pytest.fixture(scope="module")
def media_tok():
    return train_tokenizer(["what colour is the square?", "image"] * 20, 300, special_tokens=MEDIA)


def url(w=40, h=30, color=(200, 30, 30)):
    return {"type": "image_url", "image_url": {"url": data_url(png(w, h, color))}}


def test_chatml_puts_the_run_where_the_part_was(tok):
    pad = tok.token_to_id("<|media_pad|>")
    msgs = [{"role": "user", "content": [{"type": "text", "text": "what colour is "}, url(40, 30),
                                         {"type": "text", "text": " the square?"}]}]
    assert has_images(msgs) and not has_images([{"role": "user", "content": "hi"}])
    out = encode_chat(ChatTemplate(), tok, msgs, TINY, pad)
    (im,) = out.images
    assert im.grid == (4, 4)
    n = im.tokens(TINY)
    s = out.starts[0]
    assert out.ids[s: s + n] == [pad] * n and pad not in out.ids[:s] + out.ids[s + n:]
    before, after = ChatTemplate().render([{"role": "user", "content": "what colour is \0 the square?"}]).split("\0")
    assert out.ids[:s] == tok.encode(before, add_special_tokens=False).ids  # no markers in k3's own BPE
    assert out.ids[s + n:] == tok.encode(after, add_special_tokens=False).ids
    assert torch.equal(im.pixels, load_image(png(40, 30), TINY).pixels) and im.digest == load_image(png(40, 30), TINY).digest


def test_kimi_media_markers_wrap_each_run_and_files_are_read(media_tok, tmp_path):
    ids = {t: media_tok.token_to_id(t) for t in MEDIA}
    (tmp_path / "a.png").write_bytes(png(60, 20, (0, 0, 255)))
    msgs = [{"role": "user", "content": [{"type": "image", "path": "a.png"}, {"type": "text", "text": "what?"}]},
            {"role": "assistant", "content": "image"},
            {"role": "user", "content": [url(30, 30), {"type": "text", "text": "and this"}]}]
    out = encode_chat(ChatTemplate(), media_tok, msgs, TINY, ids["<|media_pad|>"], base_dir=tmp_path)
    assert [im.grid for im in out.images] == [(2, 6), (4, 4)]
    image_word = media_tok.encode("image", add_special_tokens=False).ids
    for s, im in zip(out.starts, out.images):
        n = im.tokens(TINY)
        k = len(image_word) + 2
        assert out.ids[s - k: s] == [ids["<|media_begin|>"], *image_word, ids["<|media_content|>"]]
        assert out.ids[s: s + n] == [ids["<|media_pad|>"]] * n and out.ids[s + n] == ids["<|media_end|>"]
    assert out.starts[0] < out.starts[1]


def test_k3_format_encodes_text_as_text_around_the_image(tmp_path):
    k3_tok = KimiTokenizer.from_dir(write_kimi_tokenizer(tmp_path / "tok"))
    chat = chat_template_for(k3_tok)
    pad = 7  # a byte token no text here holds
    msgs = [{"role": "user", "content": [{"type": "text", "text": "hello"}, url(),
                                         {"type": "text", "text": "<|open|> world"}]}]
    out = encode_chat(chat, k3_tok, msgs, TINY, pad)
    s, n = out.starts[0], out.images[0].tokens(TINY)
    text_only = chat.prompt(k3_tok, [{"role": "user", "content": "hello<|open|> world"}]).ids
    # the same tokens as the image-free prompt, split where the image was ("hello" | "<|open|> world" as text)
    assert out.ids[:s] + out.ids[s + n:] == text_only
    assert k3_tok.token_to_id("<|open|>") not in out.ids[s + n: s + n + 3]  # the user's "<|open|>" stayed text


@pytest.mark.parametrize("part, match, param", [
    ({"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}, "offline.*data: URL",
     "messages[0].content[1].image_url.url"),
    ({"type": "image_url", "image_url": {"url": "data:image/png,rawbytes"}}, "must be base64", None),
    ({"type": "image_url", "image_url": {"url": "data:image/png;base64,@@@"}}, "base64 is invalid", None),
    ({"type": "image_url", "image_url": {"url": data_url(CORRUPT)}}, "not an image k3 can read", None),
    ({"type": "image_url", "image_url": {"url": data_url(b"")}}, "empty", None),
    ({"type": "image_url", "image_url": {"url": data_url(png_header(0, 4))}}, "zero size", None),
    ({"type": "image_url", "image_url": {"url": data_url(png_header(10_000, 10_000))}}, "100.0 megapixels", None),
    ({"type": "image_url", "image_url": "data:..."}, "needs .*url", "messages[0].content[1]"),
    ({"type": "image", "path": "missing.png"}, "cannot read the file", "messages[0].content[1]"),
])
def test_bad_image_parts_name_the_part(tok, part, match, param):
    msgs = [{"role": "user", "content": [{"type": "text", "text": "look"}, part]}]
    with pytest.raises(ImageError, match=match) as e:
        encode_chat(ChatTemplate(), tok, msgs, TINY, tok.token_to_id("<|media_pad|>"))
    assert e.value.param.startswith("messages[0].content[1]") and (param is None or e.value.param == param)
    assert "messages[0].content[1]" in str(e.value)


def test_bad_parts_and_forged_placeholders_are_refused(tok, tmp_path):
    pad = tok.token_to_id("<|media_pad|>")
    with pytest.raises(ValueError, match=r"messages\[0\].content\[0\]: a content part must be"):
        encode_chat(ChatTemplate(), tok, [{"role": "user", "content": [{"type": "audio"}]}], TINY, pad)
    # a Jinja template's text is encoded with its special tokens: text spelling the placeholder would forge one
    kimi = KimiTokenizer.from_dir(write_kimi_tokenizer(tmp_path / "tok", k3_tokens=False, chat_template=K2_TEMPLATE))
    chat, placeholder = chat_template_for(kimi), kimi.token_to_id("[BOS]")
    ok = encode_chat(chat, kimi, [{"role": "user", "content": [url(), {"type": "text", "text": "hello"}]}], TINY,
                     placeholder)
    assert ok.ids.count(placeholder) == ok.images[0].tokens(TINY)
    forged = [{"role": "user", "content": [url(), {"type": "text", "text": "hello[BOS]"}]}]
    with pytest.raises(ValueError, match="holds the image placeholder token"):
        encode_chat(chat, kimi, forged, TINY, placeholder)


def test_sft_example_trains_the_tower_and_matches_a_hand_built_prompt(tok):
    """What SFT does with it: ids + packed images into K3ForConditionalGeneration with labels, the loss reaching the
    tower; the ids and pixels are those of the same prompt built by hand (each image's run where its part was)."""
    pad = tok.token_to_id("<|media_pad|>")
    torch.manual_seed(0)
    cfg = K3Config.preset("tiny").replace(vocab_size=tok.get_vocab_size(), num_nextn_predict_layers=0)
    model = K3ForConditionalGeneration(cfg, TINY, media_placeholder_token_id=pad)
    msgs = [{"role": "user", "content": [url(40, 30), {"type": "text", "text": "what colour?"}, url(20, 50, (0, 255, 0))]}]
    out = encode_chat(ChatTemplate(), tok, msgs, TINY, pad)
    pixels, grids = out.packed()
    ids = torch.tensor([out.ids])
    loss = model(ids, pixels, grids, labels=ids).loss
    loss.backward()
    assert torch.isfinite(loss) and model.vision_tower.patch_embed.proj.weight.grad.abs().sum() > 0
    a, b = (load_image(png(40, 30), TINY), load_image(png(20, 50, (0, 255, 0)), TINY))
    text = tok.encode(ChatTemplate().render([{"role": "user", "content": "what colour?"}]), add_special_tokens=False).ids
    head = tok.encode("<|im_start|>user\n", add_special_tokens=False).ids
    assert text[: len(head)] == head
    mid = tok.encode("what colour?", add_special_tokens=False).ids
    hand = head + [pad] * a.tokens(TINY) + mid + [pad] * b.tokens(TINY) + text[len(head) + len(mid):]
    assert out.ids == hand and grids == [a.grid, b.grid] and torch.equal(pixels, torch.cat([a.pixels, b.pixels]))
