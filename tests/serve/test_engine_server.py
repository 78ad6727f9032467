"""The app over the real engine (tiny random model, CPU) in a uvicorn thread, spoken to with the openai client:
a short request is not held back by a long prompt, and an engine failure ends every request, never a hang."""

import json
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack

import openai
import pytest
import torch

from k3 import K3Config, K3ForCausalLM
from k3.data.tokenizer import train_tokenizer
from k3.inference.engine import Engine, EngineConfig
from k3.serve import create_app

from .fake_engine import live_server

MODEL = "tiny"


@pytest.fixture
def served():
    """start(config) -> (engine, base url); everything is stopped after the test."""
    with ExitStack() as stack:
        def start(config):
            tok = train_tokenizer(["def f(x):\n    return x\n", "import os\n"] * 30, 300)
            torch.manual_seed(0)
            cfg = K3Config.preset("tiny").replace(vocab_size=tok.get_vocab_size(), num_nextn_predict_layers=0)
            engine = Engine(K3ForCausalLM(cfg).eval(), tok, config, model_name=MODEL)
            engine.start()
            stack.callback(engine.stop)  # after the server (callbacks run last-in first-out)
            url = stack.enter_context(live_server(create_app(engine)))
            return engine, url.removesuffix("/v1")

        yield start


def _health(url):
    try:
        with urllib.request.urlopen(url + "/health", timeout=5) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


@pytest.mark.slow
def test_a_short_request_is_not_held_back_by_a_long_prompt(served):
    engine, url = served(EngineConfig(num_pages=256, page_tokens=256, hash_block=256, step_tokens=256,
                                      prefill_chunk=256, long_prompt=2048, max_batch=8))
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
    kw = dict(model=MODEL, prompt=list(range(5, 25)), max_tokens=5, temperature=0)

    def timed(**more):
        t0 = time.monotonic()
        r = client.completions.create(**kw, **more)
        return time.monotonic() - t0, r

    timed()  # warm-up
    idle = min(timed()[0] for _ in range(3))
    long_prompt = [(3 * i) % 250 + 5 for i in range(8_000)]  # ~40 steps of prefill alone
    with ThreadPoolExecutor(1) as pool:
        long = pool.submit(client.completions.create, model=MODEL, prompt=long_prompt, max_tokens=2)
        while engine.stats()["running"] == 0:
            time.sleep(0.01)
        loaded, r = timed()
        still_prefilling = engine.stats()["running"] >= 1
        long.result()
    assert r.choices[0].finish_reason in ("length", "stop") and still_prefilling
    assert loaded < 8 * idle + 1.0, (loaded, idle)  # a small multiple of the idle latency, not the long prefill


def test_an_engine_failure_ends_every_request_with_a_500_and_health_says_so(served, monkeypatch):
    engine, url = served(EngineConfig(num_pages=64, page_tokens=64, hash_block=64, step_tokens=64))
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=30)
    assert _health(url)[0] == 200

    def broken(plan):
        time.sleep(0.2)  # let every request arrive first
        raise IndexError("index 4096 is out of bounds for dimension 0 with size 300")

    monkeypatch.setattr(engine.runner, "launch", broken)

    def one(stream):
        try:
            if stream:
                return list(client.completions.create(model=MODEL, prompt="x", max_tokens=4, stream=True))
            return client.completions.create(model=MODEL, prompt="x", max_tokens=4)
        except openai.APIError as e:
            return e

    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(one, [False, False, True, True]))
    for r in results:  # every waiting request ends with the reason, none hangs (the client's timeout is 30 s)
        assert isinstance(r, openai.APIError) and "index 4096" in str(r), r
    code, body = _health(url)
    assert code == 503 and body["status"] == "failed" and "IndexError" in body["error"]
    with pytest.raises(openai.APIStatusError) as e:
        client.completions.create(model=MODEL, prompt="x", max_tokens=4)
    assert e.value.status_code == 503 and "engine failed" in str(e.value)
