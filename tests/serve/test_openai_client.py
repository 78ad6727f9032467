"""A real uvicorn server on 127.0.0.1 (free port, background thread), spoken to with the official openai client."""

import time
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from k3.serve import create_app

from .fake_engine import FakeEngine, live_server

MODEL = "k3-fake"
IM_END = ("<|im_end|>",)


@pytest.fixture(scope="module")
def engine():
    e = FakeEngine(max_context=256, step_delay=0.001)
    e.start()
    yield e
    e.stop()


@pytest.fixture(scope="module")
def base_url(engine):
    with live_server(create_app(engine)) as url:
        yield url


@pytest.fixture(scope="module")
def client(base_url):
    return openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=20)


def test_models_completion_chat(client, engine):
    assert [m.id for m in client.models.list()] == [MODEL]
    c = client.completions.create(model=MODEL, prompt="Hello", max_tokens=64)
    assert c.choices[0].text == engine.expected_text() and c.choices[0].finish_reason == "stop"
    assert c.usage.total_tokens == c.usage.prompt_tokens + c.usage.completion_tokens
    assert c.usage.prompt_tokens_details.cached_tokens >= 0
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                       max_completion_tokens=64, logprobs=True, top_logprobs=2)
    assert r.choices[0].message.content == engine.expected_text(stop=IM_END)
    assert r.choices[0].message.role == "assistant" and r.choices[0].finish_reason == "stop"
    assert r.choices[0].logprobs.content[0].token == "Hello"


def test_streaming(client, engine):
    stream = client.completions.create(model=MODEL, prompt="Hello", max_tokens=64, stream=True,
                                       stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == engine.expected_text()
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(engine.script) + 1
    stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], stream=True)
    deltas = [c.choices[0].delta for c in stream]
    assert deltas[0].role == "assistant"
    assert "".join(d.content or "" for d in deltas) == engine.expected_text(stop=IM_END)


def test_errors_raise_bad_request(client):
    with pytest.raises(openai.BadRequestError, match="one choice per request"):
        client.completions.create(model=MODEL, prompt="Hello", n=2)
    with pytest.raises(openai.BadRequestError, match="does not exist"):
        client.chat.completions.create(model="gpt-9", messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        client.completions.create(model=MODEL, prompt="Hello", max_tokens=1000)
    assert client.completions.create(model=MODEL, prompt="Hello", max_tokens=2).choices[0].text


def test_32_concurrent_streams(client, engine):
    def one(i: int) -> tuple[str, str]:
        max_tokens = 8 + i % 24
        if i % 2:
            s = client.completions.create(model=MODEL, prompt=f"client {i}", max_tokens=max_tokens, stream=True)
            return "".join(c.choices[0].text for c in s), engine.expected_text(max_tokens)
        s = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": f"client {i}"}],
                                           max_tokens=max_tokens, stream=True)
        return "".join(c.choices[0].delta.content or "" for c in s), engine.expected_text(max_tokens, IM_END)

    with ThreadPoolExecutor(32) as pool:
        results = list(pool.map(one, range(32)))
    assert all(got == want for got, want in results), [r for r in results if r[0] != r[1]]


def test_client_closing_stream_cancels_request(client, engine):
    engine.repeat, engine.step_delay = 1000, 0.01  # a long, slow generation
    try:
        stream = client.completions.create(model=MODEL, prompt="Hello", max_tokens=200, stream=True)
        it = iter(stream)
        request_id = next(it).id
        next(it)
        stream.close()
        deadline = time.monotonic() + 5
        while request_id not in engine.cancelled:
            assert time.monotonic() < deadline, "closing the stream did not cancel the engine request"
            time.sleep(0.01)
    finally:
        engine.repeat, engine.step_delay = 1, 0.001
    assert client.completions.create(model=MODEL, prompt="Hello", max_tokens=3).choices[0].text
