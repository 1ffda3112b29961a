"""OpenAI request parsing, error bodies and the chat template (same ids as transformers)."""

from __future__ import annotations

import json

import pytest

from services.common.errors import InvalidArgument, NotFound, ResourceExhausted, Unauthenticated, Unavailable
from services.router import openai_format as oa
from services.router.catalog import ModelCatalog, load_served_model
from services.router.chat import ChatMessage, parse_messages
from services.router.protocol import MAX_PROMPTS
from services.router.sse import sse_event

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2? ünïcödé"},
            {"role": "assistant", "content": "4"}, {"role": "user", "content": [{"type": "text", "text": "And 3+3?"}]}]


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    return load_served_model(tiny_model_dir)


def test_chat_prompt_ids_equal_transformers_apply_chat_template(tiny, tiny_model_dir):
    from transformers import AutoTokenizer

    reference = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    hf_messages = [{**m, "content": m["content"] if isinstance(m["content"], str) else m["content"][0]["text"]}
                   for m in MESSAGES]
    expected = reference.apply_chat_template(hf_messages, add_generation_prompt=True, tokenize=True)
    expected = expected["input_ids"] if isinstance(expected, dict) or hasattr(expected, "keys") else expected
    parsed = oa.parse_chat({"messages": MESSAGES, "max_tokens": 8}, tiny, token_limit=640)
    assert list(parsed.request.prompt_ids) == list(expected)
    text = tiny.render_chat(parse_messages(MESSAGES))
    assert text == reference.apply_chat_template(hf_messages, add_generation_prompt=True, tokenize=False)
    assert text.endswith("<s>assistant\n")


def test_chat_default_max_tokens_fits_the_largest_group(tiny):
    parsed = oa.parse_chat({"messages": [{"role": "user", "content": "hi"}]}, tiny, token_limit=640)
    assert parsed.request.sampling.max_tokens == 640 - len(parsed.request.prompt_ids)
    parsed = oa.parse_chat({"messages": [{"role": "user", "content": "hi"}]}, tiny, token_limit=100_000)
    assert parsed.request.sampling.max_tokens == oa.DEFAULT_CHAT_MAX_TOKENS


def test_completion_prompt_forms(tiny):
    assert oa.parse_completion({"prompt": "hi"}, tiny).request.prompt_text == "hi"
    assert oa.parse_completion({"prompt": ["hi"]}, tiny).request.prompt_text == "hi"
    assert oa.parse_completion({"prompt": [5, 6, 7]}, tiny).request.prompt_ids == (5, 6, 7)
    assert oa.parse_completion({"prompt": [[5, 6]]}, tiny).request.prompt_ids == (5, 6)
    parsed = oa.parse_completion({"prompt": "hi", "stream": True, "stream_options": {"include_usage": True},
                                  "max_tokens": 7, "temperature": 0, "stop": "x", "seed": 3}, tiny)
    assert (parsed.stream, parsed.include_usage) == (True, True)
    s = parsed.request.sampling
    assert (s.max_tokens, s.temperature, s.stop, s.seed) == (7, 0, ("x",), 3)


def test_several_prompts_are_one_request_each(tiny):
    one = oa.parse_completions({"prompt": [[5, 6]], "echo": True, "logprobs": 1, "max_tokens": 1}, tiny)
    assert [p.request.prompt_ids for p in one] == [(5, 6)]
    several = oa.parse_completions({"prompt": [[5, 6], "hi", [7]], "echo": True, "logprobs": 1, "max_tokens": 1,
                                    "seed": 1234, "temperature": 0}, tiny)
    assert [(p.request.prompt_ids, p.request.prompt_text) for p in several] == [((5, 6), None), (None, "hi"),
                                                                                ((7,), None)]
    assert all(p.echo and p.generate and p.request.sampling.logprobs == 1 for p in several)
    assert [p.request.prompt_ids for p in oa.parse_completions({"prompt": [5, 6]}, tiny)] == [(5, 6)]
    for body, message in [
        ({"prompt": ["a", "b"], "stream": True}, "several prompts are served without streaming"),
        ({"prompt": [[5], [[6]]]}, r"prompt: none of its forms fits \(.*\[0\]: input should be a valid integer"),
        ({"prompt": ["a", 5]}, r"prompt: none of its forms fits \(.*\[1\]: input should be a valid list"),
        ({"prompt": ["a", ""]}, r"\[1\]: string should have at least 1 character"),
        ({"prompt": ["a"] * (MAX_PROMPTS + 1)}, f"list should have at most {MAX_PROMPTS} items"),
    ]:
        with pytest.raises(oa.BadRequest, match=message):
            oa.parse_completions(body, tiny)


def test_several_completions_response_has_a_choice_per_prompt():
    def answer(i: int) -> dict:
        return {"id": f"cmpl-{i}", "object": "text_completion", "created": 1, "model": "m",
                "replica_group_id": f"rg-{i}",
                "choices": [{"index": 0, "text": str(i), "finish_reason": "length", "logprobs": None}],
                "usage": {"prompt_tokens": 2, "completion_tokens": i, "total_tokens": 2 + i}}

    body = oa.several_completions_response([answer(0), answer(1), answer(2)])
    assert [(c["index"], c["text"]) for c in body["choices"]] == [(0, "0"), (1, "1"), (2, "2")]
    assert body["usage"] == {"prompt_tokens": 6, "completion_tokens": 3, "total_tokens": 9}
    assert (body["id"], body["replica_group_id"]) == ("cmpl-0", "rg-2")


@pytest.mark.parametrize(("body", "param", "message"), [
    ({"prompt": ""}, "prompt", "prompt: none of its forms fits (string should have at least 1 character"),
    ({"prompt": []}, "prompt", "prompt: none of its forms fits (input should be a valid string; list should have "
                               "at least 1 item"),
    ({"prompt": ["a", "b"]}, "prompt", "prompt: only one prompt per request"),
    ({"prompt": "a", "max_tokens": 0}, "max_tokens", "max_tokens must be an integer >= 1, got 0"),
    ({"prompt": "a", "max_tokens": -3}, "max_tokens", "max_tokens: input should be greater than or equal to 0, "
                                                       "got -3"),
    ({"prompt": "a", "temperature": -0.5}, "temperature", "temperature: input should be greater than or equal to 0, "
                                                          "got -0.5"),
    ({"prompt": "a", "top_p": 0}, "top_p", "top_p: input should be greater than 0, got 0"),
    ({"prompt": "a", "top_p": 1.5}, "top_p", "top_p: input should be less than or equal to 1, got 1.5"),
    ({"prompt": "a", "n": 17}, "n", "n: input should be less than or equal to 16, got 17"),
    ({"prompt": "a", "n": 2, "best_of": 1}, "best_of", "best_of must be at least n (2), got 1"),
    ({"prompt": "a", "best_of": 2, "stream": True}, "best_of", "best_of above n is served without streaming"),
    ({"prompt": "a", "stop": 3}, "stop", "stop: none of its forms fits (input should be a valid string; input "
                                         "should be a valid list), got 3"),
    ({"prompt": "a", "temperature": "hot"}, "temperature", "temperature: input should be a valid number, got 'hot'"),
    ({"prompt": "a", "repetition_penalty": 0}, "repetition_penalty",
     "repetition_penalty: input should be greater than 0, got 0"),
    ({"prompt": "a", "repetition_penalty": True}, "repetition_penalty",
     "repetition_penalty: input should be a valid number, got True"),
    ({"prompt": "a", "presence_penalty": 2.5}, "presence_penalty",
     "presence_penalty: input should be less than or equal to 2, got 2.5"),
])
def test_bad_fields_give_400_with_the_param(tiny, body, param, message):
    with pytest.raises(InvalidArgument) as caught:
        oa.parse_completion(body, tiny)
    status, error = oa.error_body(caught.value)
    assert status == 400 and error["error"]["param"] == param and error["error"]["message"].startswith(message)
    assert error["error"]["type"] == "invalid_request_error"


def test_the_body_vllm_bench_serve_sends_is_a_greedy_stream_with_usage(tiny):
    """What `vllm bench serve --backend vllm --ignore-eos --temperature 0` posts to /v1/completions
    (vLLM 0.32's request function, its sampling flags merged in)."""
    body = {"model": "tiny", "prompt": "some random words", "repetition_penalty": 1.0, "max_tokens": 64,
            "logprobs": None, "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True,
            "temperature": 0}
    parsed = oa.parse_completion(body, tiny)
    assert parsed.stream and parsed.include_usage and not parsed.want_logprobs and not parsed.echo
    sampling = parsed.request.sampling
    assert sampling.ignore_eos and sampling.max_tokens == 64 and sampling.temperature == 0
    assert oa.parse_completion({**body, "repetition_penalty": 1}, tiny).request.sampling == sampling
    assert oa.parse_completion({**body, "repetition_penalty": None}, tiny).request.sampling == sampling


@pytest.mark.parametrize(("exc", "status", "code"), [
    (InvalidArgument("This model's maximum context length is 2048 tokens. However, ..."), 400,
     "context_length_exceeded"),
    (Unauthenticated("incorrect API key provided"), 401, "invalid_api_key"),
    (NotFound("The model `x` does not exist"), 404, "model_not_found"),
    (ResourceExhausted("the admission queue for model 'm' is full"), 429, "queue_full"),
    (ResourceExhausted("no replica group had KV headroom ... within the queue deadline"), 429, "queue_timeout"),
    (Unavailable("no healthy replica group"), 503, "no_healthy_replica"),
])
def test_error_bodies_follow_openai(exc, status, code):
    got_status, body = oa.error_body(exc)
    assert got_status == status
    assert body == {"error": {"message": str(exc), "type": body["error"]["type"], "param": None, "code": code}}


def test_catalog_names_and_unknown_models(tiny_model_dir):
    catalog = ModelCatalog([load_served_model(tiny_model_dir, name="tiny")])
    assert catalog.get("").name == "tiny" and catalog.get("tiny").max_model_len == 2048
    with pytest.raises(NotFound, match=r"The model `llama` does not exist \(served: tiny\)"):
        catalog.get("llama")
    with pytest.raises(NotFound, match="serves no model"):
        ModelCatalog([]).get("")


def test_messages_are_validated():
    with pytest.raises(InvalidArgument, match="messages must be a non-empty list"):
        parse_messages([])
    with pytest.raises(InvalidArgument, match=r"messages\[0\].role must be one of"):
        parse_messages([{"role": "robot", "content": "x"}])
    # null content only on an assistant message (one that made tool calls), as OpenAI allows
    assert parse_messages([{"role": "assistant", "content": None}]) == [ChatMessage("assistant", "")]
    with pytest.raises(InvalidArgument, match=r"messages\[0\].content must be a string"):
        parse_messages([{"role": "user", "content": None}])


def test_sse_events_escape_the_characters_clients_split_lines_on() -> None:
    event = sse_event({"text": "a\u2028b\u2029c\x85d"})
    assert event.endswith("\n\n") and len(event[:-2].splitlines()) == 1
    assert json.loads(event.removeprefix("data: "))["text"] == "a\u2028b\u2029c\x85d"
