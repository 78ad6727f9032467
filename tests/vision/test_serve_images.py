"""OpenAI image_url parts through k3 serve (SPEC §7, §10), a real engine over a tiny multimodal model in a uvicorn
thread, spoken to with the openai client: the reply equals the model's own greedy reply to the prompt with the image
spliced in; the same image hits the prefix cache and another one does not; http URLs, corrupt bytes, zero-size and
100-megapixel images are 400s naming the part, and the server keeps serving; a text-only model refuses images."""

from contextlib import ExitStack

import openai
import pytest
import torch

from k3 import K3Config
from k3.data.tokenizer import train_tokenizer
from k3.inference.engine import Engine, EngineConfig
from k3.serve import create_app
from k3.chat import ChatTemplate
from k3.vision import K3ForConditionalGeneration, VisionConfig
from k3.vision.chat import data_url, encode_chat
from tests.serve.fake_engine import live_server
from tests.vision.images import CORRUPT, greedy_reply, png, png_header

MODEL = "tiny-vl"
TINY = VisionConfig.preset("tiny")


@pytest.fixture(scope="module")
def tok():
    return train_tokenizer(["what colour is the square?", "a red square", "<|im_start|>user\nhi<|im_end|>\n"] * 20,
                           300, special_tokens=("<|endoftext|>", "<|media_pad|>"))


@pytest.fixture(scope="module")
def served(tok):
    """(model, openai client) of a multimodal server, and the client of a text-only one."""
    torch.manual_seed(0)
    cfg = K3Config.preset("tiny").replace(vocab_size=tok.get_vocab_size(), num_nextn_predict_layers=0)
    model = K3ForConditionalGeneration(cfg, TINY, media_placeholder_token_id=tok.token_to_id("<|media_pad|>")).eval()
    config = EngineConfig(num_pages=64, page_tokens=32, hash_block=4, step_tokens=64, prefill_chunk=64)
    with ExitStack() as stack:
        clients = []
        for m in (model, model.language_model):
            engine = Engine(m, tok, config, model_name=MODEL)
            engine.start()
            stack.callback(engine.stop)
            url = stack.enter_context(live_server(create_app(engine)))
            clients.append(openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=60))
        yield model, *clients


def image(url, text="what colour is the square?"):
    return [{"role": "user", "content": [{"type": "text", "text": text}, {"type": "image_url", "image_url": {"url": url}}]}]


def ask(client, messages, max_tokens=4):
    return client.chat.completions.create(model=MODEL, messages=messages, max_tokens=max_tokens, temperature=0)




def test_reply_is_the_models_reply_to_the_image_and_the_cache_knows_images(served, tok):
    model, client, _ = served
    red, blue = data_url(png(40, 30, (220, 20, 20))), data_url(png(40, 30, (20, 20, 220)))
    r = ask(client, image(red))
    text, n_prompt = greedy_reply(model, tok, image(red))
    assert r.choices[0].message.content == text and r.usage.prompt_tokens == n_prompt
    assert r.usage.prompt_tokens_details.cached_tokens == 0
    again = ask(client, image(red))
    assert again.choices[0].message.content == text
    assert again.usage.prompt_tokens_details.cached_tokens >= n_prompt - 4  # all full blocks, image included
    other = ask(client, image(blue))  # the same tokens, another image: nothing past the image's start is reused
    start = encode_chat(ChatTemplate(), tok, image(blue), TINY, model.media_placeholder_token_id).starts[0]
    assert other.usage.prompt_tokens_details.cached_tokens <= start
    assert other.choices[0].message.content == greedy_reply(model, tok, image(blue))[0]


@pytest.mark.parametrize("url, message, param", [
    ("https://example.com/cat.png", "offline", "messages[0].content[1].image_url.url"),
    (data_url(CORRUPT), "not an image k3 can read", "messages[0].content[1]"),
    (data_url(b""), "empty", "messages[0].content[1]"),
    (data_url(png_header(0, 30)), "zero size", "messages[0].content[1]"),
    (data_url(png_header(10_000, 10_000)), "100.0 megapixels", "messages[0].content[1]"),
    ("data:image/png;base64,not base64!", "base64", "messages[0].content[1].image_url.url"),
])
def test_bad_images_are_400s_naming_the_part_and_the_server_keeps_serving(served, url, message, param):
    _, client, _ = served
    with pytest.raises(openai.BadRequestError) as e:
        ask(client, image(url))
    err = e.value.body
    assert e.value.status_code == 400 and message in err["message"] and err["param"] == param, err
    assert err["code"] == "invalid_image" and "BytesIO" not in err["message"]
    if url.startswith("data:image/png;base64,") and "base64" not in message:  # the part, and what kind of URL
        assert err["message"].startswith("messages[0].content[1] (a data:image/png;base64 URL)"), err
    assert ask(client, image(data_url(png(20, 20))), max_tokens=1).choices[0].finish_reason in ("length", "stop")


def test_a_text_only_model_refuses_images_and_still_answers_text(served):
    _, _, text_only = served
    with pytest.raises(openai.BadRequestError, match="no vision tower") as e:
        ask(text_only, image(data_url(png())))
    assert e.value.body["code"] == "unsupported_content"
    assert ask(text_only, [{"role": "user", "content": "hi"}], max_tokens=1).choices[0].finish_reason


def test_an_image_over_the_patch_budget_is_shrunk_and_the_server_says_so(tok, caplog):
    from types import SimpleNamespace

    from k3.serve.images import chat_prompt

    engine = SimpleNamespace(tokenizer=tok, vision=(TINY, tok.token_to_id("<|media_pad|>")))
    with caplog.at_level("WARNING", logger="k3.serve"):
        _, _, (im,) = chat_prompt(engine, ChatTemplate(), image(data_url(png(2000, 2000))))
    assert im.grid == (128, 128)  # 16384 patches: 2000 x 2000 -> 1792 x 1792
    assert "2000 x 2000 pixels shrunk to fit 128 x 128 patches" in caplog.text
