"""The router's OpenAPI document, and schemathesis fuzzing the real HTTP port against it: no
5xx, every response's status, content type and body as documented, and the router still serves
a normal request afterwards."""

from __future__ import annotations

import time
from collections.abc import Iterator

import httpx
import openai
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis.checks import (
    content_type_conformance,
    not_a_server_error,
    response_schema_conformance,
    status_code_conformance,
)

from tests.router.processes import router_and_worker

CHECKS = [not_a_server_error, response_schema_conformance, status_code_conformance, content_type_conformance]
EXAMPLES_PER_MODE = 25  # per operation, positive and negative each
DEADLINE_S = 90.0  # the whole fuzzing run; a slow machine fuzzes less, never longer


@pytest.fixture(scope="module")
def http(tiny_model_dir, tmp_path_factory) -> Iterator[str]:
    # a small context: a fuzzed max_tokens that the worker would have to generate for long is a 400
    with router_and_worker(tiny_model_dir, tmp_path_factory.mktemp("openapi"),
                           worker_flags=["--served-model-name", "tiny", "--kv-cache-gb", "0.02",
                                         "--replica-group-id", "rg-fuzz"],
                           router_flags=["--served-model-name", "tiny", "--max-model-len", "256"]) as stack:
        yield stack.http


def test_the_document_describes_the_api(http):
    document = httpx.get(f"{http}/openapi.json", timeout=10).json()
    assert document["openapi"].startswith("3.1")
    assert set(document["paths"]) == {"/v1/completions", "/v1/chat/completions", "/v1/models", "/health",
                                      "/tokenize", "/detokenize", "/version"}
    stream = document["paths"]["/v1/completions"]["post"]["responses"]["200"]["content"]["text/event-stream"]
    data = stream["schema"]["properties"]["data"]["anyOf"]
    assert data[1]["contentSchema"]["anyOf"][0]["$ref"] == "#/components/schemas/CompletionChunk"
    for ui in ("/docs", "/redoc"):
        assert httpx.get(f"{http}{ui}", timeout=10).status_code == 404


def test_tokenize_detokenize_and_version_over_http(http):
    from importlib.metadata import version

    ids = httpx.post(f"{http}/tokenize", json={"model": "tiny", "prompt": "hello there"}, timeout=10).json()
    assert ids["count"] == len(ids["tokens"]) > 0 and ids["max_model_len"] == 256
    text = httpx.post(f"{http}/detokenize", json={"model": "tiny", "tokens": ids["tokens"]}, timeout=10).json()
    assert text == {"prompt": "hello there"}
    missing = httpx.post(f"{http}/tokenize", json={"model": "nope", "prompt": "x"}, timeout=10)
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
    assert httpx.get(f"{http}/version", timeout=10).json() == {"version": version("shardline")}


def test_n_choices_each_equal_their_own_seeded_request(http):
    """n=3, seed=7: choice i is what an n=1 request with seed 7 + i answers, streamed or not, on
    completions and chat; best_of=3 keeps the candidate of the highest logprob sum."""
    client = openai.OpenAI(base_url=f"{http}/v1", api_key="none", max_retries=0)
    args = dict(model="tiny", prompt="once upon a time", max_tokens=12, temperature=1.0)
    alone = [client.completions.create(**args, seed=7 + i, logprobs=0) for i in range(3)]
    texts = [a.choices[0].text for a in alone]
    assert len(set(texts)) > 1  # the seeds differ, and so do the texts
    several = client.completions.create(**args, seed=7, n=3)
    assert [c.text for c in sorted(several.choices, key=lambda c: c.index)] == texts
    assert several.usage.prompt_tokens == alone[0].usage.prompt_tokens
    assert several.usage.completion_tokens == sum(a.usage.completion_tokens for a in alone)
    streamed = ["", "", ""]
    chunks = client.completions.create(**args, seed=7, n=3, stream=True, stream_options={"include_usage": True})
    for chunk in chunks:
        for choice in chunk.choices:
            streamed[choice.index] += choice.text
        if chunk.usage is not None:
            assert chunk.usage.completion_tokens == several.usage.completion_tokens
    assert streamed == texts
    usage = [chunk.usage for chunk in client.completions.create(
        **args, seed=7, stream=True, stream_options={"include_usage": True, "continuous_usage_stats": True})]
    assert all(u is not None and u.prompt_tokens == alone[0].usage.prompt_tokens for u in usage)
    assert [u.completion_tokens for u in usage][-2:] == [alone[0].usage.completion_tokens] * 2  # finish, usage
    best = client.completions.create(**args, seed=7, n=1, best_of=3)
    scores = [sum(a.choices[0].logprobs.token_logprobs) for a in alone]
    assert [c.text for c in best.choices] == [texts[scores.index(max(scores))]]
    messages = [{"role": "user", "content": "tell me a story"}]
    chat_alone = [client.chat.completions.create(model="tiny", messages=messages, max_tokens=10, seed=3 + i)
                  .choices[0].message.content for i in range(2)]
    chat = client.chat.completions.create(model="tiny", messages=messages, max_tokens=10, seed=3, n=2)
    assert [c.message.content for c in sorted(chat.choices, key=lambda c: c.index)] == chat_alone
    deltas = ["", ""]
    for chunk in client.chat.completions.create(model="tiny", messages=messages, max_tokens=10, seed=3, n=2,
                                                stream=True):
        for choice in chunk.choices:
            deltas[choice.index] += choice.delta.content or ""
    assert deltas == chat_alone


def test_the_openai_client_parses_structured_outputs(http):
    """client.chat.completions.parse with a pydantic model: the random-weight model's sampled
    answer is a valid object every time, because the schema's mask leaves nothing else."""
    import enum

    import pydantic

    class Color(enum.Enum):
        RED = "red"
        GREEN = "green"

    class Item(pydantic.BaseModel):
        color: Color
        sizes: list[int] = pydantic.Field(max_length=3)
        ok: bool

    client = openai.OpenAI(base_url=f"{http}/v1", api_key="none", max_retries=0)
    for seed in range(4):
        answer = client.chat.completions.parse(model="tiny", messages=[{"role": "user", "content": "an item"}],
                                               response_format=Item, max_tokens=120, temperature=1.0, seed=seed)
        item = answer.choices[0].message.parsed
        assert isinstance(item, Item) and answer.choices[0].finish_reason == "stop", answer
    regex = client.completions.create(model="tiny", prompt="a code:", max_tokens=20, temperature=1.0,
                                      extra_body={"guided_regex": "[A-Z]{2}[0-9]{2}"})
    assert len(regex.choices[0].text) == 4 and regex.choices[0].text[:2].isupper(), regex


def test_a_tool_call_round_trip_with_the_openai_client(http):
    """tool_choice required with n=3, streamed and not, then the tool's result and the answer: every
    choice calls the function with arguments the client parses into its pydantic model (the guide
    leaves the random-weight model nothing else), and each streamed choice equals its non-streamed
    twin (same seeds); a named function answers with its arguments and finish_reason stop."""
    from typing import Literal

    import pydantic

    class GetWeather(pydantic.BaseModel):
        city: Literal["Paris", "Oslo", "Lima"]
        celsius: bool

    client = openai.OpenAI(base_url=f"{http}/v1", api_key="none", max_retries=0)
    tool = openai.pydantic_function_tool(GetWeather, name="get_weather")
    history = [{"role": "user", "content": "weather in Paris?"}]
    asked = dict(model="tiny", tools=[tool], tool_choice="required", parallel_tool_calls=False, n=3, seed=3,
                 max_tokens=150, temperature=1.0)
    answer = client.chat.completions.parse(messages=history, **asked)
    assert [c.finish_reason for c in answer.choices] == ["tool_calls"] * 3, answer
    calls = [c.message.tool_calls for c in answer.choices]
    assert all(len(c) == 1 and c[0].function.name == "get_weather" and
               isinstance(c[0].function.parsed_arguments, GetWeather) for c in calls), calls

    streamed: dict[int, dict] = {}
    for chunk in client.chat.completions.create(messages=history, stream=True, **asked):
        for choice in chunk.choices:
            entry = streamed.setdefault(choice.index, {"name": "", "arguments": "", "finish": None})
            for call in choice.delta.tool_calls or []:
                entry["name"] += call.function.name or ""
                entry["arguments"] += call.function.arguments or ""
            entry["finish"] = choice.finish_reason or entry["finish"]
    assert streamed == {i: {"name": "get_weather", "arguments": calls[i][0].function.arguments, "finish": "tool_calls"}
                        for i in range(3)}

    call = calls[0][0]
    history += [{"role": "assistant", "content": None, "tool_calls": [
                    {"id": call.id, "type": "function",
                     "function": {"name": call.function.name, "arguments": call.function.arguments}}]},
                {"role": "tool", "tool_call_id": call.id, "content": "22 degrees and sunny"}]
    final = client.chat.completions.create(model="tiny", messages=history, tools=[tool], max_tokens=8, seed=3)
    assert isinstance(final.choices[0].message.content, str) and not final.choices[0].message.tool_calls, final

    named = client.chat.completions.create(model="tiny", messages=history[:1], tools=[tool], max_tokens=150, seed=5,
                                           tool_choice={"type": "function", "function": {"name": "get_weather"}})
    choice = named.choices[0]
    assert choice.finish_reason == "stop" and choice.message.content is None, named
    GetWeather.model_validate_json(choice.message.tool_calls[0].function.arguments)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_schemathesis_finds_nothing(http):
    schema = schemathesis.openapi.from_url(f"{http}/openapi.json")
    deadline = time.monotonic() + DEADLINE_S
    ran: dict[str, int] = {}
    statuses: dict[str, dict[int, int]] = {}

    def fuzzer(operation, mode, label):
        @settings(max_examples=EXAMPLES_PER_MODE, deadline=None, database=None, derandomize=True,
                  phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
        @given(case=operation.as_strategy(generation_mode=mode))
        def fuzz(case):
            if time.monotonic() > deadline:
                return
            ran[label] += 1
            response = case.call(base_url=http, timeout=30)
            statuses[label][response.status_code] = statuses[label].get(response.status_code, 0) + 1
            case.validate_response(response, checks=CHECKS)

        return fuzz

    for result in schema.get_all_operations():
        operation = result.ok()
        modes = [schemathesis.GenerationMode.POSITIVE]
        if operation.method.upper() == "POST":  # a GET without parameters has no negative input
            modes.append(schemathesis.GenerationMode.NEGATIVE)
        for mode in modes:
            label = f"{operation.label} {mode.value}"
            ran[label] = 0
            statuses[label] = {}
            fuzzer(operation, mode, label)()
    print("schemathesis examples per operation:", ran, "statuses:", statuses)
    assert sum(ran.values()) >= 50
    # and a normal request is still served
    client = openai.OpenAI(base_url=f"{http}/v1", api_key="none", max_retries=0)
    done = client.completions.create(model="tiny", prompt="hello", max_tokens=4, temperature=0)
    assert done.usage.completion_tokens == 4
