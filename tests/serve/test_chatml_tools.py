"""ChatML's Hermes tool calls end to end through the official openai client: a fake engine scripted to answer with
two calls (parsed into OpenAI tool_calls, streamed and not, and their results sent back), and
`k3 serve --preset tiny --random-init` as a real process (random weights write no call of their own, so there the
tests check what is real: the prompt the server renders, the forced prefix, and that the reply, a malformed call,
comes back as content with the reason, the same streamed and not)."""

import json
from contextlib import ExitStack

import openai
import pytest

from k3.chat import ChatTemplate
from k3.cli.serve import _random_tokenizer
from k3.serve import create_app

from .fake_engine import FakeEngine, live_server
from .test_real_server import _serve

MODEL = "k3-fake"
CITY = {"type": "object", "properties": {"city": {"type": "string"}}}
WEATHER = {"type": "function",
           "function": {"name": "get_weather", "description": "Weather of a city", "parameters": CITY}}
SCRIPT = ('Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
          '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call><|im_end|>ignored')
USER = [{"role": "user", "content": "Weather in Paris and Oslo?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.fixture(scope="module")
def fake():
    with ExitStack() as stack:
        engine = FakeEngine(max_context=8192, step_delay=0.001, script=SCRIPT)
        engine.start()
        stack.callback(engine.stop)
        url = stack.enter_context(live_server(create_app(engine, ChatTemplate())))
        yield openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=20), engine


def _check_calls(calls):
    assert [(c.type, c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        ("function", "get_weather", {"city": "Paris"}), ("function", "get_weather", {"city": "Oslo"})]
    assert len({c.id for c in calls}) == 2


def test_calls_parsed_streamed_and_not(fake):
    client, engine = fake
    r = client.chat.completions.create(model=MODEL, messages=USER, tools=[WEATHER])
    assert r.choices[0].finish_reason == "tool_calls" and r.choices[0].message.content == "Checking.\n"
    _check_calls(r.choices[0].message.tool_calls)
    prompt = engine.tokenizer.decode(list(engine.submitted[-1].prompt_ids))
    assert "<tools>\n" + json.dumps(WEATHER) + "\n</tools>" in prompt
    chunks = list(client.chat.completions.create(model=MODEL, messages=USER, tools=[WEATHER], stream=True))
    deltas = [t for c in chunks if c.choices for t in (c.choices[0].delta.tool_calls or [])]
    assert [d.index for d in deltas] == [0, 1] and chunks[-1].choices[0].finish_reason == "tool_calls"
    _check_calls(deltas)
    with client.chat.completions.stream(model=MODEL, messages=USER, tools=[WEATHER]) as s:
        _check_calls(s.get_final_completion().choices[0].message.tool_calls)


def test_tool_results_round_trip(fake):
    client, engine = fake
    first = client.chat.completions.create(model=MODEL, messages=USER, tools=[WEATHER]).choices[0].message
    messages = USER + [first.model_dump(exclude_none=True)] + [
        {"role": "tool", "tool_call_id": c.id, "content": json.dumps({"temp": 20 + i})}
        for i, c in enumerate(first.tool_calls)]
    client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER], tool_choice="auto")
    prompt = engine.tokenizer.decode(list(engine.submitted[-1].prompt_ids))
    assert ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call><|im_end|>\n'
            '<|im_start|>user\n<tool_response>\n{"temp": 20}\n</tool_response>\n<tool_response>\n{"temp": 21}\n'
            '</tool_response><|im_end|>\n<|im_start|>assistant\n') in prompt
    client.chat.completions.create(model=MODEL, messages=USER, tools=[WEATHER], tool_choice=NAMED)
    prompt = engine.tokenizer.decode(list(engine.submitted[-1].prompt_ids))
    assert prompt.endswith('<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": ')


@pytest.fixture(scope="module")
def real():
    for url in _serve():
        yield openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.mark.parametrize("choice", ["auto", "required", NAMED], ids=["auto", "required", "named"])
def test_random_init_server_takes_tools(real, choice):
    tok = _random_tokenizer("tiny")  # the server's own tokenizer (deterministic)
    messages = USER + [{"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_0", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]},
        {"role": "tool", "tool_call_id": "call_0", "content": '{"temp": 25}'}]
    kw = dict(model="tiny", messages=messages, tools=[WEATHER], tool_choice=choice, max_tokens=12, temperature=0.0,
              extra_body={"ignore_eos": True})
    r = real.chat.completions.create(**kw)
    expected = ChatTemplate().prompt(tok, messages, [WEATHER], choice)
    assert r.usage.prompt_tokens == len(expected.ids)  # the prompt holds the tools, the call and its result
    assert r.usage.prompt_tokens > len(ChatTemplate().prompt(tok, messages).ids)
    m = r.choices[0].message
    assert r.choices[0].finish_reason in ("length", "tool_calls")
    if choice != "auto" and not m.tool_calls:  # random weights: the forced call is malformed, kept as content
        prefix = '<tool_call>\n{"name": "' + ('get_weather", "arguments": ' if choice is NAMED else "")
        assert m.content.startswith(prefix) and m.model_extra["tool_call_error"]
    chunks = list(real.chat.completions.create(**kw, stream=True))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == (m.content or "") and chunks[-1].choices[0].finish_reason == r.choices[0].finish_reason
