"""SmolLM2-135M-Instruct behind the router: the official openai client gets what the worker and
`shardline generate` give for the same greedy request (real text, a real chat template)."""

from __future__ import annotations

import json

import grpc
import openai
import pytest

from services.common.proto import common_pb2, worker_pb2, worker_pb2_grpc
from tests.cli import run_cli
from tests.router.processes import router_and_worker

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def served(smollm2_dir, tmp_path_factory):
    with router_and_worker(smollm2_dir, tmp_path_factory.mktemp("smollm2-router"),
                           worker_flags=["--served-model-name", "smollm2", "--kv-cache-gb", "0.25"],
                           router_flags=["--served-model-name", "smollm2"], worker_timeout_s=300) as stack, \
            grpc.insecure_channel(stack.worker) as channel:
        yield (openai.OpenAI(base_url=f"{stack.http}/v1", api_key="none", max_retries=0),
               worker_pb2_grpc.WorkerServiceStub(channel))


def worker_text(worker, ids: list[int], max_tokens: int) -> tuple[str, int]:
    responses = list(worker.Generate(worker_pb2.GenerateRequest(token_ids=common_pb2.TokenIds(ids=ids),
                                                                sampling=common_pb2.SamplingParameters(
                                                                    temperature=0, max_tokens=max_tokens))))
    return "".join(r.token.text for r in responses[:-1]), len(responses) - 1


def test_completion_equals_shardline_generate(served, smollm2_dir):
    client, _worker = served
    prompt = "The capital of France is"
    out = client.completions.create(model="smollm2", prompt=prompt, max_tokens=16, temperature=0)
    reference = run_cli("generate", "--model", str(smollm2_dir), "--prompt", prompt, "--max-tokens", "16", "--json")
    assert reference.returncode == 0, reference.stderr
    expected = json.loads(reference.stdout)
    assert out.choices[0].text == expected["text"] and "Paris" in out.choices[0].text
    assert out.usage.completion_tokens == len(expected["token_ids"])
    streamed = client.completions.create(model="smollm2", prompt=prompt, max_tokens=16, temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == expected["text"]


def test_chat_uses_the_models_template_and_equals_the_worker(served, smollm2_dir):
    from transformers import AutoTokenizer

    client, worker = served
    messages = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]
    encoded = AutoTokenizer.from_pretrained(str(smollm2_dir)).apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True)
    ids = list(encoded["input_ids"] if hasattr(encoded, "keys") else encoded)
    text, n = worker_text(worker, ids, 24)
    out = client.chat.completions.create(model="smollm2", messages=messages, max_tokens=24, temperature=0)
    assert out.choices[0].message.content == text and "Paris" in text
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (len(ids), n)
    assert out.choices[0].finish_reason == ("stop" if n < 24 else "length")
    chunks = list(client.chat.completions.create(model="smollm2", messages=messages, max_tokens=24, temperature=0,
                                                 stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
