"""The OpenAI-compatible app, in process (fastapi TestClient) over the deterministic FakeEngine."""

import json

import pytest
from fastapi.testclient import TestClient

from k3.chat import ChatTemplate
from k3.serve import create_app

from .fake_engine import FakeEngine

MODEL = "k3-fake"
CHAT = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
IM_END = ("<|im_end|>",)


@pytest.fixture(scope="module")
def engine():
    e = FakeEngine(max_context=128)
    e.start()
    yield e
    e.stop()


@pytest.fixture(scope="module")
def client(engine):
    return TestClient(create_app(engine))


def complete(client, **body):
    return client.post("/v1/completions", json={"model": MODEL, "prompt": "Hello", **body})


def chat(client, **body):
    return client.post("/v1/chat/completions", json={"model": MODEL, "messages": CHAT, **body})


def sse_events(response):
    """The JSON payloads of an SSE body, and whether it ended with [DONE]."""
    assert response.headers["content-type"].startswith("text/event-stream")
    blocks = [b for b in response.text.split("\n\n") if b]
    assert all(b.startswith("data: ") for b in blocks)
    done = blocks[-1] == "data: [DONE]"
    return [json.loads(b[len("data: "):]) for b in blocks if b != "data: [DONE]"], done


def test_health_and_models(client):
    assert client.get("/health").json()["status"] == "ok"
    models = client.get("/v1/models").json()
    assert models["object"] == "list" and [m["id"] for m in models["data"]] == [MODEL]
    assert models["data"][0]["object"] == "model" and models["data"][0]["max_model_len"] == 128
    assert client.get(f"/v1/models/{MODEL}").json()["id"] == MODEL
    assert client.get("/v1/models/nope").status_code == 404


def test_completion_shape(client, engine):
    r = complete(client, max_tokens=64)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["id"].startswith("cmpl-") and body["object"] == "text_completion" and body["model"] == MODEL
    assert isinstance(body["created"], int)
    (choice,) = body["choices"]
    assert choice["index"] == 0 and choice["logprobs"] is None
    assert choice["text"] == engine.expected_text() and choice["finish_reason"] == "stop"  # EOS
    u = body["usage"]
    n_prompt = len(engine.tokenizer.encode("Hello", add_special_tokens=False).ids)
    assert u["prompt_tokens"] == n_prompt and u["completion_tokens"] == len(engine.script) + 1
    assert u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"]
    assert set(u["prompt_tokens_details"]) == {"cached_tokens"}
    assert engine.submitted[-1].request_id == body["id"]


def test_length_stop_and_token_prompt(client, engine):
    r = complete(client, max_tokens=4).json()
    assert r["choices"][0]["finish_reason"] == "length" and r["usage"]["completion_tokens"] == 4
    assert r["choices"][0]["text"] == engine.expected_text(4)  # "Hello, w" + half of "ö": U+FFFD at the end
    r = complete(client, max_tokens=64, stop=["wör", "zzz"]).json()
    assert r["choices"][0] == {**r["choices"][0], "text": "Hello, ", "finish_reason": "stop"}
    r = complete(client, max_tokens=64, stop="<|im_end|>").json()
    assert r["choices"][0]["text"] == engine.expected_text(stop=IM_END)
    ids = engine.tokenizer.encode("a prompt as ids", add_special_tokens=False).ids
    r = complete(client, prompt=ids, max_tokens=2).json()
    assert r["usage"]["prompt_tokens"] == len(ids) and list(engine.submitted[-1].prompt_ids) == ids
    r = complete(client, prompt=["one prompt in a list"], max_tokens=2)
    assert r.status_code == 200


def test_sampling_params_reach_engine(client, engine):
    complete(client, max_tokens=3, temperature=0.5, top_p=0.9, top_k=7, seed=3, stop=["x"], logprobs=2)
    p = engine.submitted[-1].params
    assert (p.max_tokens, p.temperature, p.top_p, p.top_k, p.seed, p.stop, p.logprobs) == (3, 0.5, 0.9, 7, 3, ("x",), 2)
    complete(client, temperature=None, top_k=-1)
    p = engine.submitted[-1].params
    assert (p.max_tokens, p.temperature, p.top_k, p.top_p) == (16, 1.0, 0, 1.0)


def test_cached_tokens(client):
    prompt = "a long shared prefix that the engine has seen before " * 2
    complete(client, prompt=prompt, max_tokens=1)
    again = complete(client, prompt=prompt, max_tokens=1).json()
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0


def test_completion_logprobs(client):
    body = complete(client, max_tokens=10, logprobs=2).json()
    lp = body["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(lp["text_offset"]) == 10
    assert all(isinstance(x, float) for x in lp["token_logprobs"])
    # keys are token strings: two partial-character tokens both read "\ufffd" and collide, hence <= 2
    assert all(1 <= len(t) <= 2 for t in lp["top_logprobs"]) and lp["text_offset"][0] == 0
    assert all(b - a == len(t) for a, b, t in zip(lp["text_offset"], lp["text_offset"][1:], lp["tokens"]))
    assert lp["tokens"][0] == "Hello"
    assert complete(client, max_tokens=3, logprobs=0).json()["choices"][0]["logprobs"]["top_logprobs"] == [{}] * 3


def test_chat_shape_and_template(client, engine):
    body = chat(client, max_completion_tokens=64, max_tokens=1).json()
    assert body["id"].startswith("chatcmpl-") and body["object"] == "chat.completion"
    (choice,) = body["choices"]
    assert choice["message"]["role"] == "assistant" and choice["finish_reason"] == "stop"
    assert choice["message"]["content"] == engine.expected_text(stop=IM_END)
    req = engine.submitted[-1]
    assert engine.tokenizer.decode(list(req.prompt_ids)) == ChatTemplate().render(CHAT)
    assert req.params.stop == IM_END and req.params.max_tokens == 64
    body = chat(client, stop="and").json()  # user stops come first, the template's is added
    assert engine.submitted[-1].params.stop == ("and", "<|im_end|>")
    assert body["choices"][0]["message"]["content"] == "Hello, wörld! 漢字 "
    chat(client)  # no max_tokens: until EOS, a stop string or the engine's context limit
    req = engine.submitted[-1]
    assert req.params.max_tokens is None
    parts = [{"role": "user", "content": [{"type": "text", "text": "h"}, {"type": "text", "text": "i"}]}]
    assert chat(client, messages=parts).status_code == 200
    assert engine.tokenizer.decode(list(engine.submitted[-1].prompt_ids)).startswith("<|im_start|>user\nhi<|im_end|>")


def test_chat_logprobs(client):
    lp = chat(client, max_tokens=5, logprobs=True, top_logprobs=3).json()["choices"][0]["logprobs"]
    assert len(lp["content"]) == 5
    first = lp["content"][0]
    assert first["token"] == "Hello" and first["bytes"] == list(b"Hello") and isinstance(first["logprob"], float)
    assert len(first["top_logprobs"]) == 3 and set(first["top_logprobs"][0]) == {"token", "logprob", "bytes"}
    assert b"".join(bytes(e["bytes"]) for e in lp["content"]) == "Hello, wö".encode()
    assert chat(client, max_tokens=2).json()["choices"][0]["logprobs"] is None


@pytest.mark.parametrize("body", [{"max_tokens": 64}, {"max_tokens": 5}, {"max_tokens": 64, "stop": ["m_e", "zz"]},
                                  {"max_tokens": 64, "logprobs": 1}], ids=["eos", "length", "stop", "logprobs"])
def test_completion_stream_equals_plain(client, body):
    plain = complete(client, **body).json()["choices"][0]
    chunks, done = sse_events(complete(client, stream=True, **body))
    assert done
    assert all(c["object"] == "text_completion" and "usage" not in c for c in chunks)
    assert "".join(c["choices"][0]["text"] for c in chunks) == plain["text"]
    assert [c["choices"][0]["finish_reason"] for c in chunks][-1] == plain["finish_reason"]
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])
    if "logprobs" in body:
        tokens = [t for c in chunks if c["choices"][0]["logprobs"] for t in c["choices"][0]["logprobs"]["tokens"]]
        assert tokens == plain["logprobs"]["tokens"]


def test_chat_stream_equals_plain_with_usage(client):
    plain = chat(client, max_tokens=64).json()
    chunks, done = sse_events(chat(client, max_tokens=64, stream=True, stream_options={"include_usage": True}))
    assert done and all(c["object"] == "chat.completion.chunk" for c in chunks)
    *content, last = chunks
    assert content[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    joined = "".join(c["choices"][0]["delta"].get("content", "") for c in content)
    assert joined == plain["choices"][0]["message"]["content"]
    assert content[-1]["choices"][0]["finish_reason"] == "stop"
    assert all(c["usage"] is None for c in content)
    assert last["choices"] == [] and set(last["usage"]) == set(plain["usage"])
    for key in ("prompt_tokens", "completion_tokens", "total_tokens"):  # cached_tokens may differ: same prompt twice
        assert last["usage"][key] == plain["usage"][key]


def test_engine_abort_is_reported(client, engine):
    engine.abort_after = 2
    try:
        r = complete(client, max_tokens=10)
        assert r.status_code == 503 and r.json()["error"]["type"] == "server_error"
        chunks, done = sse_events(complete(client, max_tokens=10, stream=True))
        assert done and "error" in chunks[-1]
    finally:
        engine.abort_after = None
    assert complete(client).status_code == 200


TOO_LONG = "word " * 200


def _tool(**function):
    return {"type": "function", "function": {"name": "get_weather", **function}}


def _assistant_call(**fields):
    call = {"id": "call-1", "name": "get_weather", "arguments": "{}", **fields}
    return {"role": "assistant", "content": "", "tool_calls": [
        {"id": call["id"], "type": "function", "function": {"name": call["name"], "arguments": call["arguments"]}}]}
ERRORS = {
    "unknown-model": ("c", {"model": "gpt-9"}, "model"),
    "n-2": ("c", {"n": 2}, "n"),
    "n-0": ("c", {"n": 0}, "n"),
    "max-tokens-0": ("c", {"max_tokens": 0}, "max_tokens"),
    "max-tokens-neg": ("c", {"max_tokens": -5}, "max_tokens"),
    "max-tokens-str": ("c", {"max_tokens": "5"}, "max_tokens"),
    "max-tokens-float": ("c", {"max_tokens": 5.5}, "max_tokens"),
    "context": ("c", {"max_tokens": 120, "prompt": "Hello " * 20}, "max_tokens"),
    "prompt-too-long": ("c", {"prompt": TOO_LONG}, "max_tokens"),
    "temperature-str": ("c", {"temperature": "hot"}, "temperature"),
    "temperature-neg": ("c", {"temperature": -1}, "temperature"),
    "top-p-0": ("c", {"top_p": 0}, "top_p"),
    "logprobs-6": ("c", {"logprobs": 6}, "logprobs"),
    "stream-str": ("c", {"stream": "yes"}, "stream"),
    "stop-int": ("c", {"stop": 3}, "stop"),
    "stop-empty": ("c", {"stop": [""]}, "stop"),
    "prompt-int": ("c", {"prompt": 5}, "prompt"),
    "prompt-empty": ("c", {"prompt": ""}, "prompt"),
    "prompt-batch": ("c", {"prompt": ["a", "b"]}, "prompt"),
    "prompt-bad-id": ("c", {"prompt": [1, 10**6]}, "prompt"),
    "missing-model": ("c", {"model": None}, "model"),
    "missing-prompt": ("c", {"prompt": None}, "prompt"),
    "echo": ("c", {"echo": True}, "echo"),
    "penalty": ("c", {"presence_penalty": 1.0}, "presence_penalty"),
    "chat-missing-messages": ("chat", {"messages": None}, "messages"),
    "chat-empty-messages": ("chat", {"messages": []}, "messages"),
    "chat-messages-str": ("chat", {"messages": "hi"}, "messages"),
    "chat-bad-role": ("chat", {"messages": [{"role": "bot", "content": "x"}]}, "messages.0.role"),
    "chat-image": ("chat", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages.0.content"),
    "chat-top-logprobs-alone": ("chat", {"top_logprobs": 2}, "top_logprobs"),
    "chat-n-3": ("chat", {"n": 3}, "n"),
    "chat-too-long": ("chat", {"messages": [{"role": "user", "content": TOO_LONG}]}, "max_tokens"),
    "chat-max-completion-tokens-0": ("chat", {"max_completion_tokens": 0}, "max_completion_tokens"),
    "temperature-nan": ("c", {"temperature": float("nan")}, "temperature"),
    "seed-2^64": ("c", {"seed": 2**64}, "seed"),
    "seed-below-int64": ("c", {"seed": -2**63 - 1}, "seed"),
    "prompt-lone-surrogate": ("c", {"prompt": "a\ud800b"}, "prompt"),
    "prompt-list-lone-surrogate": ("c", {"prompt": ["a\udfff"]}, "prompt.0"),
    "stop-lone-surrogate": ("c", {"stop": ["\ud800"]}, "stop.0"),
    "chat-lone-surrogate": ("chat", {"messages": [{"role": "user", "content": "x\ud800"}]}, "messages.0.content"),
    "chat-part-lone-surrogate": ("chat", {"messages": [{"role": "user",
                                                        "content": [{"type": "text", "text": "\udc00"}]}]},
                                 "messages.0.content.0.text"),
    "chat-tool-without-function": ("chat", {"tools": [{"type": "function"}]}, "tools.0.function"),
    "chat-tool-choice-undeclared": ("chat", {"tools": [{"type": "function", "function": {"name": "f"}}],
                                             "tool_choice": {"type": "function", "function": {"name": "g"}}},
                                    "tool_choice"),
    "chat-reasoning-in-chatml": ("chat", {"reasoning_effort": "high"}, "reasoning_effort"),
    "chat-reasoning-effort-unknown": ("chat", {"reasoning_effort": "extreme"}, "reasoning_effort"),
    "tool-name-lone-surrogate": ("chat", {"tools": [_tool(name="f\ud800")]}, "tools.0.function.name"),
    "tool-description-lone-surrogate": ("chat", {"tools": [_tool(description="d\udfff")]},
                                        "tools.0.function.description"),
    "tool-parameters-lone-surrogate": ("chat", {"tools": [_tool(parameters={
        "type": "object", "properties": {"city": {"type": "string", "description": "x\ud800"}}})]},
        "tools.0.function.parameters"),
    "tool-parameter-key-lone-surrogate": ("chat", {"tools": [_tool(parameters={"properties": {"c\udc00": {}}})]},
                                          "tools.0.function.parameters"),
    "tool-call-arguments-lone-surrogate": ("chat", {"messages": [*CHAT, _assistant_call(arguments='{"a": "\ud800"}')]},
                                           "messages.2.tool_calls.0.function.arguments"),
    "tool-call-name-lone-surrogate": ("chat", {"messages": [*CHAT, _assistant_call(name="g\ud800")]},
                                      "messages.2.tool_calls.0.function.name"),
    "tool-call-id-lone-surrogate": ("chat", {"messages": [*CHAT, _assistant_call(id="c\ud800")]},
                                    "messages.2.tool_calls.0.id"),
    "reasoning-content-lone-surrogate": ("chat", {"messages": [*CHAT, {"role": "assistant", "content": "ok",
                                                                       "reasoning_content": "hm\ud800"}]},
                                         "messages.2.reasoning_content"),
    "tool-message-id-lone-surrogate": ("chat", {"messages": [*CHAT, {"role": "tool", "content": "1",
                                                                     "tool_call_id": "\udbff"}]},
                                       "messages.2.tool_call_id"),
}


@pytest.mark.parametrize("name", list(ERRORS))
def test_errors_are_openai_400s_and_server_keeps_serving(client, name):
    route, patch, param = ERRORS[name]
    body = {"model": MODEL, **({"prompt": "Hello"} if route == "c" else {"messages": CHAT}), **patch}
    body = {k: v for k, v in body.items() if v is not None}
    url = "/v1/completions" if route == "c" else "/v1/chat/completions"
    # json.dumps as a client would send it: lone surrogates escaped ("\\ud800"), nan as NaN
    r = client.post(url, content=json.dumps(body), headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error"
    assert err["param"] == param, err
    assert isinstance(err["message"], str) and len(err["message"]) > 10
    assert "surrogate" in err["message"] or "surrogate" not in name
    if name == "tool-parameters-lone-surrogate":  # the place inside the schema is named too
        assert "properties.city.description" in err["message"], err
    assert complete(client, max_tokens=2).status_code == 200


@pytest.mark.parametrize("seed", [0, -1, -2**63, 2**64 - 1])
def test_any_seed_the_sampler_takes_is_accepted(client, seed):
    assert complete(client, max_tokens=2, seed=seed).status_code == 200


@pytest.mark.parametrize("raw", [b"{not json", b"[1, 2]", b"", b'"a string"'], ids=["malformed", "list", "empty",
                                                                                     "string"])
def test_malformed_bodies(client, raw):
    for url in ("/v1/completions", "/v1/chat/completions"):
        r = client.post(url, content=raw, headers={"content-type": "application/json"})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["type"] == "invalid_request_error" and err["message"]
    assert complete(client, max_tokens=2).status_code == 200


def test_messages_name_the_problem(client):
    err = complete(client, n=2).json()["error"]
    assert "n=2" in err["message"] and "one choice" in err["message"]
    err = complete(client, max_tokens=120, prompt="Hello " * 20).json()["error"]
    assert "maximum context length is 128" in err["message"] and err["code"] == "context_length_exceeded"
    err = complete(client, model="gpt-9").json()["error"]
    assert "gpt-9" in err["message"] and MODEL in err["message"] and err["code"] == "model_not_found"
    err = client.post("/v1/completions", content=b"{oops", headers={"content-type": "application/json"}).json()
    assert "not valid JSON" in err["error"]["message"]
    err = client.post("/v1/completions", content=b'{"model": "k3-fake"}').json()  # no content-type header
    assert "Content-Type: application/json" in err["error"]["message"]


@pytest.mark.parametrize("raw", [b'{"model": "k3-fake", "prompt": "\xff\xfe"}', b"\xc3(", b'{"prompt": "a\xc3"}'])
def test_invalid_utf8_body_is_named(client, raw):
    r = client.post("/v1/completions", content=raw, headers={"content-type": "application/json"})
    err = r.json()["error"]
    assert r.status_code == 400 and err["code"] == "invalid_encoding", err
    assert "not valid UTF-8" in err["message"] and "offset" in err["message"]
    assert complete(client, max_tokens=2).status_code == 200


@pytest.mark.parametrize("effort,rendered", [("minimal", "low"), ("low", "low"), ("medium", "high"),
                                             ("high", "high"), ("xhigh", "max"), ("max", "max"), ("none", None)])
def test_reasoning_effort_takes_openais_values(effort, rendered):
    from k3.chat.xtml import KimiK3Chat

    engine = FakeEngine(max_context=2048)
    engine.start()
    try:
        r = chat(TestClient(create_app(engine, KimiK3Chat())), reasoning_effort=effort, max_tokens=2)
    finally:
        engine.stop()
    assert r.status_code == 200, r.text
    prompt = engine.tokenizer.decode(list(engine.submitted[-1].prompt_ids), skip_special_tokens=False)
    if rendered is None:
        assert "thinking_effort" not in prompt
    else:
        assert f"thinking_effort={rendered}`" in prompt


def test_unknown_route_is_openai_error(client):
    r = client.get("/v1/nothing")
    assert r.status_code == 404 and r.json()["error"]["message"]
