"""Every field of OpenAI's request bodies, as the installed ``openai`` SDK lists them, is honoured,
a hint with no effect, or a 400 that names it: never a 200 that silently ignores what was asked."""

from __future__ import annotations

import json
import typing

import pytest
from openai.types import completion_create_params
from openai.types.chat import completion_create_params as chat_create_params

from services.common.errors import InvalidArgument
from services.router import openai_format as oa
from services.router.catalog import load_served_model
from services.router.request_fields import BY_ENDPOINT, FIELDS, markdown_table

BASE = {"completions": {"prompt": "hello there"}, "chat": {"messages": [{"role": "user", "content": "hi"}]}}

# a value of each unsupported field that asks for something
ASKING: dict[str, typing.Any] = {
    "suffix": " end",
    "guided_grammar": "root ::= \"a\"", "structured_outputs": {"json": {}},
    "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}], "tool_choice": "required",
    "functions": [{"name": "f"}], "function_call": {"name": "f"}, "audio": {"voice": "alloy", "format": "wav"},
    "modalities": ["text", "audio"], "web_search_options": {}, "moderation": {"model": "x"}, "store": True,
    "service_tier": "flex", "reasoning_effort": "low", "verbosity": "high", "include_stop_str_in_output": True,
    "skip_special_tokens": False, "add_generation_prompt": False, "continue_final_message": True,
    "chat_template": "{{ messages }}", "chat_template_kwargs": {"enable_thinking": True},
}
# a value of each hint
HINTS: dict[str, typing.Any] = {
    "user": "u-1", "safety_identifier": "s-1", "metadata": {"team": "a"}, "prompt_cache_key": "k",
    "prompt_cache_retention": "24h", "prompt_cache_options": {}, "prediction": {"type": "content", "content": "x"},
    "parallel_tool_calls": True,
}


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    return load_served_model(tiny_model_dir)


def parse(endpoint: str, body: dict, model):
    if endpoint == "completions":
        return oa.parse_completion(body, model)
    return oa.parse_chat(body, model, token_limit=256)


@pytest.mark.parametrize(("endpoint", "params"), [("completions", completion_create_params.CompletionCreateParamsBase),
                                                  ("chat", chat_create_params.CompletionCreateParamsBase)])
def test_every_field_the_sdk_sends_has_a_status(endpoint, params):
    sdk = set(typing.get_type_hints(params)) | {"stream"}
    assert not sdk - set(BY_ENDPOINT[endpoint]), f"fields with no status: {sorted(sdk - set(BY_ENDPOINT[endpoint]))}"


@pytest.mark.parametrize("field", [f for f in FIELDS if f.status == "unsupported"], ids=lambda f: f.name)
def test_an_unsupported_field_is_a_400_naming_it_unless_off(tiny, field):
    for endpoint in field.endpoints:
        with pytest.raises(InvalidArgument) as caught:
            parse(endpoint, {**BASE[endpoint], field.name: ASKING[field.name]}, tiny)
        status, body = oa.error_body(caught.value)
        assert status == 400 and body["error"]["param"] == field.name, body
        assert body["error"]["message"].startswith(f"{field.name} is not supported"), body
        plain = parse(endpoint, BASE[endpoint], tiny)
        for off in (None, *field.off):
            assert parse(endpoint, {**BASE[endpoint], field.name: off}, tiny) == plain, (field.name, off)


@pytest.mark.parametrize("field", [f for f in FIELDS if f.status == "hint"], ids=lambda f: f.name)
def test_a_hint_is_accepted_and_changes_nothing(tiny, field):
    for endpoint in field.endpoints:
        assert parse(endpoint, {**BASE[endpoint], field.name: HINTS[field.name]}, tiny) == \
            parse(endpoint, BASE[endpoint], tiny)


def test_a_field_of_the_other_endpoint_is_a_400(tiny):
    with pytest.raises(InvalidArgument, match="echo is a completions parameter"):
        oa.parse_chat({**BASE["chat"], "echo": True}, tiny, token_limit=256)
    with pytest.raises(InvalidArgument, match="max_completion_tokens is a chat parameter"):
        oa.parse_completion({**BASE["completions"], "max_completion_tokens": 5}, tiny)
    assert oa.parse_chat({**BASE["chat"], "echo": False}, tiny, token_limit=256) == \
        oa.parse_chat(BASE["chat"], tiny, token_limit=256)


def test_continuous_usage_stats_needs_include_usage(tiny):
    with pytest.raises(InvalidArgument, match="continuous_usage_stats needs include_usage"):
        oa.parse_completion({**BASE["completions"], "stream": True,
                             "stream_options": {"continuous_usage_stats": True}}, tiny)
    both = {"include_usage": True, "continuous_usage_stats": True}
    assert oa.parse_completion({**BASE["completions"], "stream": True, "stream_options": both},
                               tiny).continuous_usage


def test_the_docs_list_every_field_with_its_status():
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[2] / "docs" / "openai.md").read_text()
    assert markdown_table() in doc, "docs/openai.md's request-field table differs from request_fields.markdown_table()"


def test_logit_bias_min_p_and_min_tokens_reach_the_sampling_params(tiny):
    body = {**BASE["completions"], "logit_bias": {"7": 5, "3": -100}, "min_p": 0.2, "min_tokens": 4,
            "max_tokens": 8}
    sampling = oa.parse_completion(body, tiny).request.sampling
    assert (sampling.logit_bias, sampling.min_p, sampling.min_tokens) == (((3, -100), (7, 5)), 0.2, 4)
    chat = oa.parse_chat({**BASE["chat"], "logit_bias": {"7": 5}}, tiny, token_limit=256).request.sampling
    assert chat.logit_bias == ((7, 5),)
    for bad in ({"logit_bias": {"x": 1}}, {"logit_bias": {str(tiny.vocab_size): 1}}, {"logit_bias": {"1": 500}},
                {"logit_bias": [1]}, {"min_p": 2}, {"min_tokens": 9, "max_tokens": 8}):
        with pytest.raises(InvalidArgument) as caught:
            oa.parse_completion({**BASE["completions"], **bad}, tiny)
        assert oa.error_body(caught.value)[1]["error"]["param"] == next(iter(bad)), bad


def test_structured_output_fields_become_a_checked_guide(tiny):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    cases = [({"response_format": {"type": "json_object"}}, ("json_schema", '{"type": "object"}')),
             ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}},
              ("json_schema", json.dumps(schema))),
             ({"guided_json": schema}, ("json_schema", json.dumps(schema))),
             ({"guided_regex": "[0-9]+"}, ("regex", "[0-9]+")),
             ({"guided_choice": ["yes", "no"]}, ("choice", '["yes", "no"]')),
             ({"response_format": {"type": "text"}}, None)]
    for fields, guide in cases:
        assert oa.parse_chat({**BASE["chat"], **fields}, tiny, token_limit=256).request.sampling.guide == guide
        assert oa.parse_completion({**BASE["completions"], **fields}, tiny).request.sampling.guide == guide
    for bad, param in (({"guided_regex": "[0-9"}, "guided_regex"), ({"guided_choice": []}, "guided_choice"),
                       ({"response_format": {"type": "xml"}}, "response_format"),
                       ({"response_format": {"type": "json_schema"}}, "response_format"),
                       ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice")):
        with pytest.raises(InvalidArgument) as caught:
            oa.parse_completion({**BASE["completions"], **bad}, tiny)
        assert oa.error_body(caught.value)[1]["error"]["param"] == param, bad
