"""`k3 serve --preset tiny --random-init` as a real server process, driven by the official openai client."""

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

MODEL = "tiny"


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _health(url):
    with urllib.request.urlopen(url + "/health", timeout=5) as r:
        return json.loads(r.read())


def _serve(*flags):
    port = _free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "k3", "serve", "--preset", "tiny", "--random-init", "--port", str(port),
                             "--device", "cpu", *flags], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        try:
            _health(url)
            break
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise RuntimeError("k3 serve did not start: " + proc.stderr.read().decode()[-2000:])
            time.sleep(0.3)
    yield url
    proc.terminate()
    proc.wait(timeout=20)


@pytest.fixture(scope="module")
def server():
    yield from _serve("--num-pages", "512", "--page-tokens", "64", "--hash-block", "64", "--checkpoint-every", "2")


@pytest.fixture(scope="module")
def default_server():
    """`k3 serve` with every engine option at its default (the pool: 512 pages of 1024 tokens on the CPU)."""
    yield from _serve()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def default_client(default_server):
    return openai.OpenAI(base_url=default_server + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.mark.slow
def test_streaming_joins_to_the_non_streaming_text(client):
    kw = dict(model=MODEL, prompt="def main():\n", max_tokens=12, temperature=0)
    full = client.completions.create(**kw)
    streamed = "".join(c.choices[0].text for c in client.completions.create(stream=True, **kw) if c.choices)
    assert streamed == full.choices[0].text and full.usage.completion_tokens >= 1
    chat = dict(model=MODEL, messages=[{"role": "user", "content": "hello"}], max_tokens=8, temperature=0)
    whole = client.chat.completions.create(**chat).choices[0].message.content
    parts = [c.choices[0].delta.content or "" for c in client.chat.completions.create(stream=True, **chat) if c.choices]
    assert "".join(parts) == whole


def test_32_concurrent_streams_complete(client):
    kw = dict(model=MODEL, prompt="import sys\n", max_tokens=10, temperature=0)
    expected = client.completions.create(**kw).choices[0].text

    def one(_):
        chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        return text, chunks[-1].usage

    with ThreadPoolExecutor(32) as pool:
        results = list(pool.map(one, range(32)))
    assert all(text == expected for text, _ in results)
    assert all(u is not None and u.completion_tokens == results[0][1].completion_tokens for _, u in results)


def test_prefix_cache_reports_cached_tokens(client):
    prompt = "class Config:\n    value = 1\n" * 40  # a few hundred tokens
    first = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0)
    second = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    cached = second.usage.prompt_tokens_details.cached_tokens
    n = second.usage.prompt_tokens  # the repeat hits at the prompt's last full 64-token block
    assert cached == (n - 1) // 64 * 64 and cached > 0
    assert second.choices[0].text == first.choices[0].text


@pytest.mark.parametrize("kw,param", [({"model": "nope"}, "model"), ({"n": 2}, "n"), ({"max_tokens": 0}, "max_tokens"),
                                      ({"max_tokens": 10**7}, None), ({"temperature": "hot"}, "temperature")])
def test_bad_requests_get_400_and_the_server_keeps_serving(client, kw, param):
    args = {"model": MODEL, "prompt": "x", "max_tokens": 2, **kw}
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(**args)
    assert e.value.status_code == 400 and e.value.body.get("type") == "invalid_request_error"
    assert client.completions.create(model=MODEL, prompt="x", max_tokens=2).choices[0].finish_reason


def test_malformed_json_is_a_400(server):
    req = urllib.request.Request(server + "/v1/completions", data=b"{not json", method="POST",
                                 headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=10)
    assert e.value.code == 400 and "error" in json.loads(e.value.read())


@pytest.mark.slow
def test_disconnect_mid_stream_frees_the_cache(client, server):
    stream = client.completions.create(model=MODEL, prompt="while True:\n", max_tokens=400, temperature=0.8,
                                       stream=True)
    next(iter(stream))
    assert _health(server)["running"] >= 1
    stream.close()
    deadline = time.monotonic() + 20
    while (h := _health(server))["running"] or h["pages_in_use"]:
        assert time.monotonic() < deadline, h
        time.sleep(0.1)


@pytest.mark.slow
def test_a_repeated_1379_token_prompt_hits_at_its_last_512_token_block(default_client):
    ids = [(7 * i) % 1000 + 10 for i in range(1379)]
    first = default_client.completions.create(model=MODEL, prompt=ids, max_tokens=3, temperature=0)
    second = default_client.completions.create(model=MODEL, prompt=ids, max_tokens=3, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert second.usage.prompt_tokens_details.cached_tokens == 1024
    assert second.choices[0].text == first.choices[0].text


@pytest.mark.slow
def test_chat_without_max_tokens_on_a_default_server(default_client, default_server):
    """What most OpenAI clients send: no max_tokens. It generates until EOS or the context limit; the client reads
    a few tokens and leaves, and the pages come back."""
    models = default_client.models.list().data
    assert models[0].max_model_len == _health(default_server)["max_context"]  # the advertised limit is the true one
    stream = default_client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                    stream=True, temperature=0.8, seed=1)
    got = [c for _, c in zip(range(12), stream)]
    assert len(got) == 12 and all(c.choices[0].finish_reason is None for c in got[1:])
    stream.close()
    deadline = time.monotonic() + 20
    while (h := _health(default_server))["running"] or h["pages_in_use"]:
        assert time.monotonic() < deadline, h
        time.sleep(0.1)
