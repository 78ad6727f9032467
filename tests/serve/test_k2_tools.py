"""Kimi K2's tool calls: its Jinja template gets the request's tools, the streamed reply is split into content and
calls (``functions.NAME:IDX`` ids, JSON arguments), malformed sections come back as text with the reason."""

import json

import pytest

from k3.data.kimi_tokenizer import KimiTokenizer
from k3.chat import ChatError, JinjaChatTemplate, PlainOutput, chat_template_for
from k3.chat.k2_tools import K2Output, parse_k2_section
from tests.data.kimi_files import write_kimi_tokenizer

# the shape of Kimi K2's template: tools declared in a tool_declare system turn, an assistant turn's calls in the
# section format, tool results by id (written for the test: the release's template is longer, same markers)
K2_TOOL_TEMPLATE = (
    "{% if tools %}<|im_system|>tool_declare<|im_middle|>{{ tools | tojson }}<|im_end|>{% endif %}"
    "{% for m in messages %}<|im_{{ m.role if m.role != 'tool' else 'system' }}|>{{ m.role }}<|im_middle|>"
    "{% if m.role == 'tool' %}## Return of {{ m.tool_call_id }}\n{% endif %}{{ m.content or '' }}"
    "{% if m.tool_calls %}<|tool_calls_section_begin|>{% for c in m.tool_calls %}<|tool_call_begin|>{{ c.id }}"
    "<|tool_call_argument_begin|>{{ c.function.arguments }}<|tool_call_end|>{% endfor %}"
    "<|tool_calls_section_end|>{% endif %}<|im_end|>{% endfor %}"
    "{% if add_generation_prompt %}<|im_assistant|>assistant<|im_middle|>{% endif %}")
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}
TOOLS = {"get_weather": WEATHER, "get_time": TIME}
REPLY = ("Let me check.<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
         '<|tool_call_argument_begin|>{"city": "Paris", "unit": "°C"}<|tool_call_end|>'
         "<|tool_call_begin|> functions.get_time:1 <|tool_call_argument_begin|>{}<|tool_call_end|>"
         "<|tool_calls_section_end|>")


def events(parser, text, step):
    out = []
    for i in range(0, len(text), step):
        out += parser.feed(text[i:i + step])
    return out + parser.finish()


def merged(evs):
    """Adjacent content events joined (how they are cut depends on the stream's pieces)."""
    out = []
    for e in evs:
        if out and e.kind == out[-1][0] == "content":
            out[-1] = ("content", out[-1][1] + e.text, "", "")
        else:
            out.append((e.kind, e.text, e.name, e.id))
    return out


@pytest.mark.parametrize("step", [1, 2, 7, 1000])
def test_streamed_reply_splits_into_content_and_calls(step):
    assert merged(events(K2Output(TOOLS), REPLY, step)) == [
        ("content", "Let me check.", "", ""),
        ("tool_call", json.dumps({"city": "Paris", "unit": "°C"}, ensure_ascii=False), "get_weather",
         "functions.get_weather:0"),
        ("tool_call", "{}", "get_time", "functions.get_time:1")]


def test_singular_section_markers_and_text_after_the_section():
    text = REPLY.replace("calls_section", "call_section") + " Done."
    evs = merged(events(K2Output(TOOLS), text, 3))
    assert [e[0] for e in evs] == ["content", "tool_call", "tool_call", "content"] and evs[-1][1] == " Done."


@pytest.mark.parametrize("text, why", [
    (REPLY[:-len("<|tool_calls_section_end|>")], "was not closed"),
    (REPLY.replace('{"city": "Paris", "unit": "°C"}', "{city: Paris}"), "not JSON"),
    (REPLY.replace("{}", "[1, 2]"), "must be a JSON object"),
    (REPLY.replace("functions.get_time", "functions.rm_rf"), "'rm_rf', which is not among the declared tools"),
    (REPLY.replace("<|tool_call_begin|> functions", "stray<|tool_call_begin|> functions"), "text outside a call"),
    ("<|tool_calls_section_begin|><|tool_calls_section_end|>", "no complete call"),
])
def test_a_malformed_section_is_text_with_the_reason(text, why):
    evs = events(K2Output(TOOLS), text, 5)
    err = [e for e in evs if e.kind == "error"]
    assert len(err) == 1 and why in err[0].name and "<|tool_call" in err[0].text
    assert not [e for e in evs if e.kind == "tool_call"]


def test_section_parser_names_and_ids():
    calls = parse_k2_section(REPLY[REPLY.index("<|tool_call_begin|>"):-len("<|tool_calls_section_end|>")], TOOLS)
    assert [(c["id"], c["name"]) for c in calls] == [("functions.get_weather:0", "get_weather"),
                                                     ("functions.get_time:1", "get_time")]


@pytest.fixture
def k2(tmp_path):
    d = write_kimi_tokenizer(tmp_path, k3_tokens=False, chat_template=K2_TOOL_TEMPLATE, k2_tool_tokens=True)
    return KimiTokenizer.from_dir(d)


def test_the_template_gets_the_tools_and_the_reply_is_parsed(k2):
    t = chat_template_for(k2)
    assert isinstance(t, JinjaChatTemplate) and t.tool_format == "kimi_k2" and t.supports_tools
    call = {"id": "functions.get_weather:0", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    msgs = [{"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "functions.get_weather:0", "content": '{"temp": 21}'}]
    text = t.render(msgs, tools=[WEATHER])
    assert text.startswith("<|im_system|>tool_declare<|im_middle|>[{") and '"get_weather"' in text
    assert "<|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>" in text
    assert "## Return of functions.get_weather:0" in text
    p = t.prompt(k2, msgs, tools=[WEATHER])
    assert isinstance(p.parser, K2Output) and p.parser.tools.keys() == {"get_weather"}
    assert k2.decode(p.ids) == text  # the markers are the tokenizer's special tokens
    none = t.prompt(k2, msgs, tools=[WEATHER], tool_choice="none")
    assert isinstance(none.parser, PlainOutput) and "tool_declare" not in k2.decode(none.ids)
    with pytest.raises(ChatError, match="cannot be forced in Kimi K2's format"):
        t.render(msgs, tools=[WEATHER], tool_choice="required")
    with pytest.raises(ChatError, match="reasoning_effort is not supported"):
        t.render(msgs, reasoning_effort="high")
