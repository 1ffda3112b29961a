"""Tool calling's rules without a server: the request checks, each parser, the required guide's
schema, and a stream's deltas adding up to the non-streamed message however the text is cut."""

from __future__ import annotations

import json

import pytest

from services.router.chat import parse_messages, render_chat
from services.router.request_fields import BadRequest
from services.router.tools import ToolCallStream, message, parse_tool_calling

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "the weather in a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}


def calling(choice=None, parser="hermes", **body):
    return parse_tool_calling({"tools": [WEATHER, TIME], **({"tool_choice": choice} if choice else {}), **body},
                              parser)


@pytest.mark.parametrize("body,param", [
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "tools"),
    ({"tools": [WEATHER, WEATHER]}, "tools"),
    ({"tools": [{"type": "retrieval"}]}, "tools"),
    ({"tools": [WEATHER], "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
])
def test_bad_tools_name_their_field(body, param):
    with pytest.raises(BadRequest) as caught:
        parse_tool_calling(body, "hermes")
    assert caught.value.param == param


def test_no_tools_means_no_tool_calling():
    assert parse_tool_calling({}, "hermes") is None
    assert parse_tool_calling({"tools": [], "tool_choice": "none"}, "hermes") is None
    assert calling().choice == "auto" and calling().guide() is None


def test_required_guides_a_list_of_calls_each_with_its_own_parameters():
    kind, spec = calling("required", parallel_tool_calls=False).guide()
    schema = json.loads(spec)
    assert kind == "json_schema" and schema["minItems"] == 1 and schema["maxItems"] == 1
    names = [alt["properties"]["name"]["enum"] for alt in schema["items"]["anyOf"]]
    assert names == [["get_weather"], ["get_time"]]
    assert schema["items"]["anyOf"][0]["properties"]["parameters"] == WEATHER["function"]["parameters"]
    named = calling({"type": "function", "function": {"name": "get_weather"}})
    assert named.guide() == ("json_schema", json.dumps(WEATHER["function"]["parameters"]))


@pytest.mark.parametrize("choice,parser,text,content,calls,reason", [
    ("auto", "hermes", 'Let me look.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
     "Let me look.", [("get_weather", {"city": "Paris"})], "tool_calls"),
    ("auto", "hermes", '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>\n<tool_call>{"name": '
     '"get_weather", "arguments": {"city": "Oslo"}}</tool_call>', None,
     [("get_time", {}), ("get_weather", {"city": "Oslo"})], "tool_calls"),
    ("auto", "hermes", "No tools <tool_ needed.", "No tools <tool_ needed.", [], "stop"),
    ("auto", "hermes", "<tool_call>{not json</tool_call>", "<tool_call>{not json</tool_call>", [], "stop"),
    ("auto", "llama3_json", '{"name": "get_weather", "parameters": {"city": "Rome"}}', None,
     [("get_weather", {"city": "Rome"})], "tool_calls"),
    ("auto", "llama3_json", '<|python_tag|>{"name": "get_time", "parameters": {}}; {"name": "get_time", '
     '"parameters": {}}', None, [("get_time", {}), ("get_time", {})], "tool_calls"),
    ("auto", "llama3_json", "It is sunny.", "It is sunny.", [], "stop"),
    ("required", "hermes", '[{"name":"get_weather","parameters":{"city":"Lima"}}]', None,
     [("get_weather", {"city": "Lima"})], "tool_calls"),
    ({"type": "function", "function": {"name": "get_weather"}}, "hermes", '{"city":"Kyiv"}', None,
     [("get_weather", {"city": "Kyiv"})], "stop"),
    ("none", "hermes", '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>',
     '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>', [], "stop"),
])
def test_parsers_and_streams_give_the_same_message(choice, parser, text, content, calls, reason):
    tools = calling(choice, parser)
    body, finish = message(tools, text, "stop")
    assert body["content"] == content and finish == reason
    got = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in body.get("tool_calls", [])]
    assert got == calls
    for cut in (1, 3, 7, len(text)):  # the same message from the deltas, however the text comes
        stream = ToolCallStream(tools)
        deltas = [d for i in range(0, len(text), cut) for d in stream.feed(text[i:i + cut])]
        last, streamed_reason = stream.finish("stop")
        streamed_content, streamed_calls = "", {}
        for delta in deltas + last:
            streamed_content += delta.get("content", "")
            for call in delta.get("tool_calls", []):
                entry = streamed_calls.setdefault(call["index"], {"name": "", "arguments": ""})
                entry["name"] += call.get("function", {}).get("name", "")
                entry["arguments"] += call["function"].get("arguments", "")
        assert (streamed_content or None) == content and streamed_reason == reason, (cut, deltas, last)
        assert [(c["name"], json.loads(c["arguments"])) for c in streamed_calls.values()] == calls


def test_a_cut_call_is_returned_as_text_unless_the_function_was_named():
    text = '[{"name":"get_weather","parameters":{"ci'
    assert message(calling("required"), text, "length") == ({"role": "assistant", "content": text}, "length")
    stream = ToolCallStream(calling("required"))
    assert stream.feed(text) == [] and stream.finish("length") == ([{"content": text}], "length")
    named = calling({"type": "function", "function": {"name": "get_weather"}})
    body, reason = message(named, '{"ci', "length")
    assert reason == "length" and body["content"] is None and body["tool_calls"][0]["function"] == {
        "name": "get_weather", "arguments": '{"ci'}
    stream = ToolCallStream(named)
    assert stream.feed('{"ci')[0]["tool_calls"][0]["function"]["arguments"] == '{"ci'
    assert stream.finish("length") == ([], "length")


def test_tool_history_and_tools_reach_the_template():
    template = ("{% if tools %}TOOLS {{ tools | map(attribute='function.name') | join(',') }}\n{% endif %}"
                "{% for m in messages %}{{ m.role }}:{{ m.content }}"
                "{% for c in m.tool_calls or [] %} call {{ c.function.name }} {{ c.function.arguments.city }}"
                "{% endfor %}{% if m.tool_call_id %} for {{ m.tool_call_id }}{% endif %};{% endfor %}")
    messages = parse_messages([
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Nice"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}])
    rendered = render_chat(template, messages, tools=[WEATHER, TIME])
    assert rendered == ("TOOLS get_weather,get_time\n"
                        "user:weather?;assistant: call get_weather Nice;tool:sunny for call_1;")
    with pytest.raises(Exception, match="tool_call_id"):
        parse_messages([{"role": "tool", "content": "sunny"}])
