"""Prompt logprobs through the front door: ``echo`` with ``logprobs`` on /v1/completions (raw
HTTP and the official `openai` client) and RouterService.Score over gRPC give the numbers
`shardline score` gives on the same text (float32, the tiny model), in OpenAI's shape."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import openai
import pytest

from services.common.proto import common_pb2, router_pb2, router_pb2_grpc
from tests.cli import run_cli
from tests.router.processes import RouterStack, router_and_worker

pytestmark = pytest.mark.slow

TEXT = "The quick brown fox jumps over the lazy dog."
MODEL = "tiny"


@pytest.fixture(scope="module")
def stack(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RouterStack]:
    with router_and_worker(tiny_model_dir, tmp_path_factory.mktemp("echo"),
                           worker_flags=["--served-model-name", MODEL, "--kv-cache-gb", "0.02"],
                           router_flags=["--served-model-name", MODEL]) as running:
        yield running


@pytest.fixture(scope="module")
def reference(tiny_model_dir: Path) -> dict:
    result = run_cli("score", "--model", str(tiny_model_dir), "--text", TEXT, "--json")
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_echo_gives_the_prompt_logprobs_of_shardline_score(stack: RouterStack, reference: dict) -> None:
    response = httpx.post(f"{stack.http}/v1/completions", json={
        "model": MODEL, "prompt": TEXT, "echo": True, "logprobs": 3, "max_tokens": 0, "temperature": 0}, timeout=60)
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    logprobs = choice["logprobs"]
    assert choice["text"] == TEXT and choice["finish_reason"] == "length"
    assert len(logprobs["tokens"]) == reference["n_tokens"] == response.json()["usage"]["prompt_tokens"]
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    assert logprobs["token_logprobs"][1:] == pytest.approx(reference["logprobs"], abs=1e-5)
    assert logprobs["tokens"][0] == "<s>" and "".join(logprobs["tokens"][1:]) == TEXT  # BOS, as the model adds it
    assert logprobs["text_offset"][0] == 0 and logprobs["text_offset"] == sorted(logprobs["text_offset"])
    for i, top in enumerate(logprobs["top_logprobs"][1:]):
        assert 1 <= len(top) <= 3  # fewer when two tokens render alike (partial UTF-8 shows as U+FFFD)
        assert max(top.values()) >= logprobs["token_logprobs"][i + 1]
    assert response.headers["x-shardline-replica-group-id"]


def test_openai_client_echo_with_generated_tokens(stack: RouterStack, reference: dict) -> None:
    client = openai.OpenAI(base_url=f"{stack.http}/v1", api_key="none", max_retries=0, timeout=60)
    completion = client.completions.create(model=MODEL, prompt=TEXT, echo=True, logprobs=1, max_tokens=4,
                                           temperature=0)
    choice = completion.choices[0]
    assert choice.text.startswith(TEXT) and completion.usage.completion_tokens == 4
    lp = choice.logprobs
    n = reference["n_tokens"]
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == n + 4
    assert lp.token_logprobs[0] is None
    assert lp.token_logprobs[1:n] == pytest.approx(reference["logprobs"], abs=1e-5)
    # greedy generation: each generated token is its position's best alternative (lm-eval's is_greedy)
    for token_lp, top in zip(lp.token_logprobs[n:], lp.top_logprobs[n:]):
        assert token_lp == max(top.values())
    # token ids as the prompt, as lm-eval's local-completions sends them
    ids_answer = httpx.post(f"{stack.http}/v1/completions", json={
        "model": MODEL, "prompt": [reference_ids(stack)], "echo": True, "logprobs": 1, "max_tokens": 0},
        timeout=60).json()
    assert ids_answer["choices"][0]["logprobs"]["token_logprobs"][1:] == pytest.approx(reference["logprobs"],
                                                                                        abs=1e-5)
    assert ids_answer["choices"][0]["text"] == TEXT


def test_several_prompts_in_one_request_as_lm_eval_batches_them(stack: RouterStack, reference: dict) -> None:
    """lm-eval's local-completions with batch_size > 1: token-id prompts in one request, echo with
    logprobs and one generated token; one choice per prompt, ``index`` its position, each the
    answer that prompt gets alone."""
    ids = reference_ids(stack)
    prompts = [ids, ids[:5], ids[:9]]
    lm_eval_body = {"model": MODEL, "temperature": 0, "max_tokens": 1, "logprobs": 1, "seed": 1234, "echo": True}
    batch = httpx.post(f"{stack.http}/v1/completions", json={**lm_eval_body, "prompt": prompts}, timeout=60)
    assert batch.status_code == 200, batch.text
    choices = batch.json()["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2]
    alone = [httpx.post(f"{stack.http}/v1/completions", json={**lm_eval_body, "prompt": [p]}, timeout=60).json()
             for p in prompts]
    for prompt, choice, single in zip(prompts, choices, alone, strict=True):
        assert len(choice["logprobs"]["token_logprobs"]) == len(prompt) + 1
        assert choice["logprobs"]["token_logprobs"][1:] == pytest.approx(
            single["choices"][0]["logprobs"]["token_logprobs"][1:], abs=1e-5)
        assert choice["text"] == single["choices"][0]["text"]
    assert choices[0]["logprobs"]["token_logprobs"][1:len(ids)] == pytest.approx(reference["logprobs"], abs=1e-5)
    assert batch.json()["usage"]["prompt_tokens"] == sum(len(p) for p in prompts)
    # without echo: greedy completions of two text prompts, each as it comes alone
    plain = {"model": MODEL, "temperature": 0, "max_tokens": 3}
    two = httpx.post(f"{stack.http}/v1/completions", json={**plain, "prompt": [TEXT, "hello"]}, timeout=60).json()
    for i, text in enumerate([TEXT, "hello"]):
        single = httpx.post(f"{stack.http}/v1/completions", json={**plain, "prompt": text}, timeout=60).json()
        assert two["choices"][i]["index"] == i and two["choices"][i]["text"] == single["choices"][0]["text"]
    assert two["usage"]["completion_tokens"] == 6


def reference_ids(stack: RouterStack) -> list[int]:
    with grpc.insecure_channel(stack.router) as channel:
        scored = router_pb2_grpc.RouterServiceStub(channel).Score(router_pb2.RouterScoreRequest(text=TEXT),
                                                                  timeout=60)
    return [t.token_id for t in scored.tokens]


def test_grpc_score(stack: RouterStack, reference: dict) -> None:
    with grpc.insecure_channel(stack.router) as channel:
        stub = router_pb2_grpc.RouterServiceStub(channel)
        scored = stub.Score(router_pb2.RouterScoreRequest(model=MODEL, text=TEXT, top_logprobs=2), timeout=60)
        assert len(scored.tokens) == reference["n_tokens"] and scored.replica_group_id
        assert list(scored.logprobs) == pytest.approx(reference["logprobs"], abs=1e-5)
        assert scored.perplexity == pytest.approx(reference["perplexity"], rel=1e-5)
        assert [len(t.alternatives) for t in scored.top_logprobs] == [2] * (reference["n_tokens"] - 1)
        assert [t.alternatives[0].token_id for t in scored.top_logprobs] == reference["argmax"]
        by_ids = stub.Score(router_pb2.RouterScoreRequest(
            token_ids=common_pb2.TokenIds(ids=[t.token_id for t in scored.tokens])), timeout=60)
        assert list(by_ids.logprobs) == list(scored.logprobs)
        with pytest.raises(grpc.RpcError) as too_many:
            stub.Score(router_pb2.RouterScoreRequest(text=TEXT, top_logprobs=21), timeout=60)
        assert too_many.value.code() == grpc.StatusCode.INVALID_ARGUMENT


@pytest.mark.parametrize(("route", "body", "param"), [
    ("completions", {"prompt": TEXT, "echo": True, "stream": True}, "echo"),
    ("completions", {"prompt": TEXT, "echo": True, "logprobs": 21, "max_tokens": 0}, "logprobs"),
    ("completions", {"prompt": TEXT, "max_tokens": 0}, "max_tokens"),
    ("completions", {"prompt": [TEXT, TEXT], "stream": True}, "stream"),
    ("completions", {"prompt": [TEXT, [1, 2], 3]}, "prompt"),
    ("chat/completions", {"messages": [{"role": "user", "content": "hi"}], "echo": True}, "echo"),
])
def test_bad_echo_requests_are_400(stack: RouterStack, route: str, body: dict, param: str) -> None:
    response = httpx.post(f"{stack.http}/v1/{route}", json={"model": MODEL, **body}, timeout=60)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["type"] == "invalid_request_error"
