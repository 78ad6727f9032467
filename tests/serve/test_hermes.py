"""ChatML's Hermes tool calls (k3/chat/hermes.py): rendering as Qwen2.5's template does, and the reply parser,
streamed in every chunk split."""

import json

import pytest

from k3.chat import ChatError, ChatTemplate
from k3.chat.hermes import HermesOutput

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                            "parameters": {"type": "object",
                                                           "properties": {"city": {"type": "string"}}}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
TOOLS = [WEATHER, TIME]
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}


def test_tools_render_in_the_system_turn_as_qwen_does():
    text = ChatTemplate().render([{"role": "system", "content": "Be brief."},
                                  {"role": "user", "content": "Weather?"}], TOOLS)
    assert text == (
        "<|im_start|>system\nBe brief.\n\n# Tools\n\nYou may call one or more functions to assist with the user query."
        "\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
        + json.dumps(WEATHER) + "\n" + json.dumps(TIME) + "\n</tools>\n\nFor each function call, return a json object "
        "with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": "
        "<function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n"
        "<|im_start|>user\nWeather?<|im_end|>\n<|im_start|>assistant\n")
    # no system message: the tools get a system turn of their own; tool_choice none: no tools at all
    assert ChatTemplate().render([{"role": "user", "content": "x"}], TOOLS).startswith("<|im_start|>system\n# Tools")
    assert ChatTemplate().render([{"role": "user", "content": "x"}], TOOLS, "none") == \
        "<|im_start|>user\nx<|im_end|>\n<|im_start|>assistant\n"


def test_calls_and_results_round_trip():
    msgs = [{"role": "user", "content": "Paris and the time?"},
            {"role": "assistant", "content": "Checking.", "tool_calls": [
                CALL, {"id": "c2", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'},
            {"role": "tool", "tool_call_id": "c2", "content": "12:00"}]
    text = ChatTemplate().render(msgs, TOOLS, "auto")
    assert ('<|im_start|>assistant\nChecking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}'
            '\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call><|im_end|>\n'
            '<|im_start|>user\n<tool_response>\n{"temp": 21}\n</tool_response>\n<tool_response>\n12:00\n'
            '</tool_response><|im_end|>\n<|im_start|>assistant\n') in text
    # what the model is taught to write for that assistant message is what the parser reads back
    ids = ChatTemplate().completion_ids(_Chars(), msgs[1])
    written = "".join(map(chr, ids)).removesuffix("<|im_end|>")
    p = HermesOutput({"get_weather": WEATHER, "get_time": TIME})
    events = p.feed(written) + p.finish()
    assert [(e.kind, e.text, e.name) for e in events] == [
        ("content", "Checking.\n", ""), ("tool_call", '{"city": "Paris"}', "get_weather"),
        ("tool_call", "{}", "get_time")]


def test_forced_calls_prefill_the_start_of_the_call():
    msgs = [{"role": "user", "content": "x"}]
    named = {"type": "function", "function": {"name": "get_weather"}}
    assert ChatTemplate().render(msgs, TOOLS, "required").endswith('<|im_start|>assistant\n<tool_call>\n{"name": "')
    assert ChatTemplate().render(msgs, TOOLS, named).endswith(
        '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": ')
    # the parser has read the prefill: the model's continuation completes the call
    for choice, rest in (("required", 'get_time", "arguments": {}}\n</tool_call>'),
                         (named, '{"city": "Oslo"}}\n</tool_call>')):
        p = ChatTemplate().prompt(_Chars(), msgs, TOOLS, choice).parser
        events = p.feed(rest) + p.finish()
        assert [e.kind for e in events] == ["tool_call"] and json.loads(events[0].text) in ({}, {"city": "Oslo"})
    with pytest.raises(ChatError, match="not among the tools") as e:
        ChatTemplate().render(msgs, TOOLS, {"type": "function", "function": {"name": "nope"}})
    assert e.value.param == "tool_choice"
    with pytest.raises(ChatError, match="reasoning_effort"):
        ChatTemplate().render(msgs, TOOLS, reasoning_effort="high")


REPLY = ('I will look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
         '<tool_call>\n{"name": "get_time", "arguments": "{}"}\n</tool_call>')


def _events(text, cuts):
    p, out, at = HermesOutput({"get_weather": WEATHER, "get_time": TIME}), [], 0
    for c in [*cuts, len(text)]:
        out += p.feed(text[at:c])
        at = c
    out += p.finish()
    return out


def _merged(events):
    """Adjacent content pieces joined (how a client reassembles a stream)."""
    out = []
    for e in events:
        if out and e.kind == out[-1][0] == "content":
            out[-1] = ("content", out[-1][1] + e.text, "")
        else:
            out.append((e.kind, e.text, e.name))
    return out


@pytest.mark.parametrize("text", [REPLY, "no calls, only <tool text> and <tool_cal",
                                  "a <tool_call>{bad json</tool_call> b \n",
                                  REPLY + "\n then \n " + REPLY + " \n"])
def test_parser_is_the_same_in_every_chunk_split(text):
    whole = _merged(_events(text, []))
    for cut in range(len(text) + 1):
        assert _merged(_events(text, [cut])) == whole, cut
    assert _merged(_events(text, list(range(1, len(text))))) == whole  # one character at a time


def test_parsed_calls_and_malformed_output_is_kept_as_content():
    assert _merged(_events(REPLY, [])) == [("content", "I will look.\n", ""),
                                            ("tool_call", '{"city": "Paris"}', "get_weather"),
                                            ("tool_call", "{}", "get_time")]
    bad = _events("a <tool_call>{bad json</tool_call> b", [])
    assert [(e.kind, e.text) for e in bad] == [("content", "a "), ("error", "<tool_call>{bad json</tool_call>"),
                                               ("content", " b")]
    assert "not JSON" in bad[1].name
    undeclared = _events('<tool_call>{"name": "rm", "arguments": {}}</tool_call>', [])
    assert undeclared[0].kind == "error" and "not among the declared tools" in undeclared[0].name
    cut = _events('<tool_call>{"name": "get_time", "argu', [])
    assert [(e.kind, e.text) for e in cut] == [("error", '<tool_call>{"name": "get_time", "argu')]
    assert "not closed" in cut[0].name
    assert _events("<tool_call>", [])[0].kind == "error"


class _Chars:
    """A tokenizer stand-in: one id per character."""

    class _E:
        def __init__(self, ids):
            self.ids = ids

    def encode(self, text, add_special_tokens=False):
        return self._E([ord(c) for c in text])
