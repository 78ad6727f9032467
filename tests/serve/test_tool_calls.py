"""OpenAI tools / tool_choice / tool_calls / role "tool" through the official openai client, against a fake engine
scripted to answer in K3's chat format (k3.chat.xtml)."""

import json
from contextlib import ExitStack

import openai
import pytest

from k3.serve import create_app
from k3.chat.xtml import KimiK3Chat

from .fake_engine import FakeEngine, live_server

MODEL = "k3-fake"
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                                                            "days": {"type": "integer"}}}}}
CALLS = ('<|open|>tools<|sep|><|open|>call tool="get_weather" index="1"<|sep|>'
         '<|open|>argument key="city" type="string"<|sep|>Paris<|close|>argument<|sep|>'
         '<|open|>argument key="days" type="number"<|sep|>2<|close|>argument<|sep|><|close|>call<|sep|>'
         '<|open|>call tool="get_weather" index="2"<|sep|><|open|>json type="object"<|sep|>{"city": "Oslo"}'
         '<|close|>json<|sep|><|close|>call<|sep|><|close|>tools<|sep|>')
TOOL_REPLY = "Checking.<|close|>response<|sep|>" + CALLS + "<|close|>message<|sep|><|end_of_msg|>ignored"
BROKEN_REPLY = "Checking.<|close|>response<|sep|>" + CALLS.replace('"Oslo"}', '"Oslo"') + \
    "<|close|>message<|sep|><|end_of_msg|>"
USER = [{"role": "user", "content": "Weather in Paris and Oslo?"}]


@pytest.fixture(scope="module")
def clients():
    """Two servers in K3's chat format: one whose model writes two good calls, one whose calls are malformed."""
    with ExitStack() as stack:
        out = {}
        for name, script in (("good", TOOL_REPLY), ("broken", BROKEN_REPLY)):
            engine = FakeEngine(max_context=8192, step_delay=0.001, script=script)
            engine.start()
            stack.callback(engine.stop)
            url = stack.enter_context(live_server(create_app(engine, KimiK3Chat())))
            out[name] = (openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=20), engine)
        yield out


def _check_calls(calls):
    assert [(c.type, c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        ("function", "get_weather", {"city": "Paris", "days": 2}), ("function", "get_weather", {"city": "Oslo"})]
    assert len({c.id for c in calls}) == 2 and all(c.id.startswith("call_") for c in calls)


def test_tool_calls(clients):
    client, engine = clients["good"]
    r = client.chat.completions.create(model=MODEL, messages=USER, tools=[WEATHER], tool_choice="auto")
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Checking."
    _check_calls(choice.message.tool_calls)
    prompt = engine.tokenizer.decode(list(engine.submitted[-1].prompt_ids))
    assert '<|open|>message role="system" type="tool-declare"<|sep|>' in prompt and '"name":"get_weather"' in prompt


def test_streamed_tool_calls_in_openais_delta_format(clients):
    client, _ = clients["good"]
    chunks = list(client.chat.completions.create(model=MODEL, messages=USER, tools=[WEATHER], stream=True))
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    deltas = [t for c in chunks if c.choices for t in (c.choices[0].delta.tool_calls or [])]
    assert content == "Checking." and [d.index for d in deltas] == [0, 1]
    _check_calls(deltas)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    # the openai client's own accumulator turns the stream into the same message
    with client.chat.completions.stream(model=MODEL, messages=USER, tools=[WEATHER]) as s:
        final = s.get_final_completion()
    _check_calls(final.choices[0].message.tool_calls)


def test_tool_results_go_back_to_the_model(clients):
    client, engine = clients["good"]
    first = client.chat.completions.create(model=MODEL, messages=USER, tools=[WEATHER]).choices[0].message
    messages = USER + [first.model_dump(exclude_none=True)] + [
        {"role": "tool", "tool_call_id": c.id, "content": json.dumps({"temp": 20 + i})}
        for i, c in enumerate(first.tool_calls)]
    r = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER])
    assert r.choices[0].finish_reason == "tool_calls"
    prompt = engine.tokenizer.decode(list(engine.submitted[-1].prompt_ids))
    assert prompt.count('<|open|>message role="tool" name="get_weather"<|sep|>{"temp": 2') == 2
    assert '<|open|>argument key="city" type="string"<|sep|>Paris<|close|>argument<|sep|>' in prompt
    with pytest.raises(openai.BadRequestError, match="matches no tool_calls id"):
        client.chat.completions.create(model=MODEL, messages=USER + [{"role": "tool", "tool_call_id": "nope",
                                                                      "content": "x"}])


def test_malformed_tool_output_is_text_with_a_flag(clients):
    client, _ = clients["broken"]
    r = client.chat.completions.create(model=MODEL, messages=USER, tools=[WEATHER])
    m = r.choices[0].message
    assert r.choices[0].finish_reason == "stop" and not m.tool_calls
    assert m.content.startswith("Checking.<|open|>tools<|sep|>") and "not JSON" in m.model_extra["tool_call_error"]
    chunks = list(client.chat.completions.create(model=MODEL, messages=USER, tools=[WEATHER], stream=True))
    flagged = [c.choices[0].delta for c in chunks if c.choices and c.choices[0].delta.model_extra.get("tool_call_error")]
    assert len(flagged) == 1 and "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == m.content


def test_tool_choice(clients):
    client, engine = clients["good"]
    named = {"type": "function", "function": {"name": "get_weather"}}
    client.chat.completions.create(model=MODEL, messages=USER, tools=[WEATHER], tool_choice=named)
    prompt = engine.tokenizer.decode(list(engine.submitted[-1].prompt_ids))
    assert prompt.endswith('<|open|>tools<|sep|><|open|>call tool="get_weather" index="1"<|sep|>')
    client.chat.completions.create(model=MODEL, messages=USER, tools=[WEATHER], tool_choice="none")
    assert "tool-declare" not in engine.tokenizer.decode(list(engine.submitted[-1].prompt_ids))
    with pytest.raises(openai.BadRequestError, match="names the function 'nope'"):
        client.chat.completions.create(model=MODEL, messages=USER, tools=[WEATHER],
                                       tool_choice={"type": "function", "function": {"name": "nope"}})
