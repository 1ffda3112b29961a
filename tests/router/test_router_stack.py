"""The router over real processes: two replica groups of the tiny model (TP2/PP1 and TP1/PP2),
a router with an API key, a small admission queue and real Redis as its health store, reached
over real gRPC and, with the official `openai` client, over HTTP."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import httpx
import openai
import pytest
import redis
from tokenizers import Tokenizer

from services.common.health import HealthStore, make_health_store, rank_fields
from services.common.proto import common_pb2, router_pb2, router_pb2_grpc, worker_pb2, worker_pb2_grpc
from tests.router.processes import start_service, stop, wait_serving
from tests.stack import free_port

API_KEY = "sk-shardline-test"
AUTH = (("authorization", f"Bearer {API_KEY}"),)
BPT = 2048  # KV bytes per token per rank of the tiny model at TP2 and at PP2
CAPACITY_TOKENS = 40 * 16  # 40 blocks of 16 tokens per group
KV_GB = str(CAPACITY_TOKENS * BPT / 2**30)
QUEUE_TIMEOUT_S = 2.0
HEALTHY = common_pb2.REPLICA_GROUP_STATUS_HEALTHY
UNHEALTHY = common_pb2.REPLICA_GROUP_STATUS_UNHEALTHY
# Equal loads tie-break to the lower id, so tests that expect traffic to move put the load on rg-pp2.
FIRST, SECOND = "rg-pp2", "rg-tp2"


@dataclass
class Stack:
    router: router_pb2_grpc.RouterServiceStub
    http: str
    workers: dict[str, worker_pb2_grpc.WorkerServiceStub]
    store: HealthStore
    client: openai.OpenAI
    model_dir: Path
    redis_url: str


@pytest.fixture(scope="module")
def stack(tiny_model_dir: Path, redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    logs = tmp_path_factory.mktemp("router-stack")
    common = ["--model", str(tiny_model_dir), "--served-model-name", "tiny", "--kv-cache-gb", KV_GB]
    started = [start_service("worker", [*common, "--tp", "2", "--replica-group-id", "rg-tp2"], logs / "tp2.log"),
               start_service("worker", [*common, "--pp", "2", "--replica-group-id", "rg-pp2"], logs / "pp2.log")]
    procs = [p for p, _ in started]
    try:
        for (proc, address), name in zip(started, ("tp2", "pp2"), strict=True):
            wait_serving(proc, address, logs / f"{name}.log")
        http_port = free_port()
        router_proc, router_address = start_service("router", [
            "--model", str(tiny_model_dir), "--served-model-name", "tiny", "--worker", started[0][1],
            "--worker", started[1][1], "--redis-url", redis_url, "--api-key", API_KEY, "--max-queue", "1",
            "--queue-timeout", str(QUEUE_TIMEOUT_S), "--http-port", str(http_port)], logs / "router.log")
        procs.append(router_proc)
        wait_serving(router_proc, router_address, logs / "router.log", timeout_s=30)
        channels = [grpc.insecure_channel(a) for a in (router_address, started[0][1], started[1][1])]
        http = f"http://127.0.0.1:{http_port}"
        yield Stack(router=router_pb2_grpc.RouterServiceStub(channels[0]), http=http,
                    workers={"rg-tp2": worker_pb2_grpc.WorkerServiceStub(channels[1]),
                             "rg-pp2": worker_pb2_grpc.WorkerServiceStub(channels[2])},
                    store=make_health_store(redis_url),
                    client=openai.OpenAI(base_url=f"{http}/v1", api_key=API_KEY, max_retries=0),
                    model_dir=tiny_model_dir, redis_url=redis_url)
        for channel in channels:
            channel.close()
    finally:
        # the router first; workers get less patience (a PP2 worker that saw a cancelled stream
        # can hang in its own shutdown, which is the worker's business, not the router's)
        codes = [stop(proc, timeout_s=30 if i == 0 else 10) for i, proc in enumerate(reversed(procs))]
    assert codes[0] == 0, (logs / "router.log").read_text()
    assert "Traceback" not in (logs / "router.log").read_text()


# ---- helpers ------------------------------------------------------------------------------


def sampling(**kw) -> common_pb2.SamplingParameters:
    return common_pb2.SamplingParameters(**kw)


def generate(stack: Stack, *, ids: list[int] | None = None, text: str | None = None, model: str = "",
             metadata=AUTH, **kw) -> list[router_pb2.RouterGenerateResponse]:
    request = router_pb2.RouterGenerateRequest(model=model, sampling=sampling(**kw))
    if ids is not None:
        request.token_ids.ids.extend(ids)
    if text is not None:
        request.text = text
    return list(stack.router.Generate(request, metadata=metadata, timeout=60))


def worker_greedy(stack: Stack, group: str, ids: list[int], max_tokens: int, **kw) -> tuple[list[int], str]:
    responses = list(stack.workers[group].Generate(worker_pb2.GenerateRequest(
        token_ids=common_pb2.TokenIds(ids=ids), sampling=sampling(temperature=0, max_tokens=max_tokens, **kw))))
    return [r.token.token_id for r in responses[:-1]], "".join(r.token.text for r in responses[:-1])


def groups(stack: Stack) -> dict[str, router_pb2.ReplicaGroupInfo]:
    listing = stack.router.ListReplicaGroups(router_pb2.ListReplicaGroupsRequest(), metadata=AUTH)
    return {g.replica_group_id: g for g in listing.groups}


def wait_until(condition: Callable[[], bool], timeout_s: float = 5.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"{what} not met within {timeout_s} s"
        time.sleep(0.05)


def all_released(stack: Stack) -> bool:
    return all(g.kv_bytes_reserved == 0 for g in groups(stack).values())


def wait_idle(stack: Stack) -> None:
    """Until no group holds reservations or, as last reported, KV blocks: loads start equal."""
    wait_until(lambda: all(g.kv_bytes_reserved == 0 and g.kv_bytes_used == 0 for g in groups(stack).values()),
               what="both groups idle")


class Held:
    """A gRPC stream kept open (placed, its first token read) until cancelled."""

    def __init__(self, stack: Stack, ids: list[int], max_tokens: int) -> None:
        self.call = stack.router.Generate(router_pb2.RouterGenerateRequest(
            token_ids=common_pb2.TokenIds(ids=ids),
            sampling=sampling(temperature=0, max_tokens=max_tokens, ignore_eos=True)), metadata=AUTH)
        self.first = next(self.call)
        self.group = self.first.replica_group_id

    def cancel(self) -> None:
        self.call.cancel()


def http_post(stack: Stack, path: str, body: dict, *, key: str | None = API_KEY) -> httpx.Response:
    headers = {"authorization": f"Bearer {key}"} if key else {}
    return httpx.post(f"{stack.http}{path}", json=body, headers=headers, timeout=60)


# ---- listing, health, metrics -------------------------------------------------------------


def test_models_and_groups_as_the_router_sees_them(stack):
    models = stack.router.ListModels(router_pb2.ListModelsRequest(), metadata=AUTH).models
    assert [(m.name, m.max_model_len, m.vocab_size, m.replica_groups, m.healthy_replica_groups) for m in models] \
        == [("tiny", 2048, 512, 2, 2)]
    listing = stack.router.ListReplicaGroups(router_pb2.ListReplicaGroupsRequest(model="tiny"), metadata=AUTH).groups
    assert [g.replica_group_id for g in listing] == ["rg-pp2", "rg-tp2"]
    for g, layout in zip(listing, [(1, 2), (2, 1)], strict=True):
        assert (g.layout.tp_degree, g.layout.pp_degree, g.layout.dtype) == (*layout, common_pb2.DTYPE_FLOAT32)
        assert (g.kv_bytes_capacity, g.kv_bytes_per_token, g.kv_bytes_reserved) == (CAPACITY_TOKENS * BPT, BPT, 0)
        assert g.status == HEALTHY and g.model == "tiny" and g.last_report_ms > 0
    assert stack.router.ListReplicaGroups(router_pb2.ListReplicaGroupsRequest(model="other"), metadata=AUTH) \
        .groups == []
    assert [m.id for m in stack.client.models.list().data] == ["tiny"]
    health = httpx.get(f"{stack.http}/health")
    assert health.status_code == 200 and health.json() == {"status": "ok", "replica_groups": 2,
                                                           "healthy_replica_groups": 2}


def test_metrics_endpoint_exposes_router_metrics(stack):
    generate(stack, ids=[5, 6, 7], max_tokens=4, temperature=0)
    text = httpx.get(f"{stack.http}/metrics").text
    assert 'shardline_kv_cache_usage_ratio{replica_group_id="rg-tp2"}' in text
    assert 'shardline_requests_running{replica_group_id=' in text
    assert "shardline_router_queue_depth 0.0" in text
    assert 'shardline_router_requests_total{model="tiny",outcome="length"}' in text


def test_a_repeated_prompt_hits_the_prefix_cache_unless_salted(stack):
    """A 40-token prompt sent again reuses its 2 full blocks on the group that computed it (its
    worker's Stats and the router's /metrics count them), and gets the same text; with a
    cache_salt it shares nothing with unsalted requests; an empty salt is a 400 naming it."""
    prompt = list(range(100, 140))
    before = {g: w.Stats(worker_pb2.StatsRequest()) for g, w in stack.workers.items()}
    first = stack.client.completions.create(model="tiny", prompt=prompt, max_tokens=4, temperature=0)
    group, worker = first.replica_group_id, stack.workers[first.replica_group_id]
    again = worker_greedy(stack, group, prompt, 4)
    after = worker.Stats(worker_pb2.StatsRequest())
    assert after.prefix_cache_hits - before[group].prefix_cache_hits == 32
    assert after.prefix_cache_queries - before[group].prefix_cache_queries == 80
    assert again[1] == first.choices[0].text and after.blocks_cached >= 2
    salted = worker.Generate(worker_pb2.GenerateRequest(
        token_ids=common_pb2.TokenIds(ids=prompt), sampling=sampling(temperature=0, max_tokens=4, cache_salt="t1")))
    assert "".join(r.token.text for r in list(salted)[:-1]) == first.choices[0].text
    assert worker.Stats(worker_pb2.StatsRequest()).prefix_cache_hits == after.prefix_cache_hits
    out = stack.client.completions.create(model="tiny", prompt=prompt, max_tokens=4, temperature=0,
                                          extra_body={"cache_salt": "t1"})
    assert out.choices[0].text == first.choices[0].text
    with pytest.raises(openai.BadRequestError) as caught:
        stack.client.completions.create(model="tiny", prompt=prompt, max_tokens=4, extra_body={"cache_salt": ""})
    assert caught.value.body["param"] == "cache_salt"
    deadline = time.monotonic() + 10
    hits = f'shardline_prefix_cache_hits_total{{replica_group_id="{group}"}}'
    while True:  # the router shows the worker's counters from its next Stats poll on
        lines = [line for line in httpx.get(f"{stack.http}/metrics").text.splitlines() if line.startswith(hits)]
        if lines and float(lines[0].split()[-1]) >= after.prefix_cache_hits or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert lines and float(lines[0].split()[-1]) >= after.prefix_cache_hits


def metric(stack: Stack, name: str, group: str) -> float:
    prefix = f'{name}{{replica_group_id="{group}"}} '
    lines = [line for line in httpx.get(f"{stack.http}/metrics").text.splitlines() if line.startswith(prefix)]
    return float(lines[0].split()[-1]) if lines else 0.0


def test_requests_sharing_a_prefix_follow_it_to_the_group_that_caches_it(stack):
    """The router mirrors each group's prefix cache from its Stats: once the group that served a
    64-token system prompt has reported its 4 blocks, six requests that start with it all go there (one
    at a time, so it is never busier than the other), each reusing the 4 blocks."""
    system = list(range(200, 264))
    first = stack.client.completions.create(model="tiny", prompt=system + [1], max_tokens=2, temperature=0)
    home = first.replica_group_id
    other = SECOND if home == FIRST else FIRST
    # the router's mirror has the prefix once it shows the count the worker reports now: the Stats
    # reply that counts the blocks brought their names too (the count alone may already be 4 or
    # more from earlier tests' prompts, before this one's names have come)
    cached = stack.workers[home].Stats(worker_pb2.StatsRequest()).blocks_cached
    assert cached >= 4
    wait_until(lambda: metric(stack, "shardline_prefix_cache_blocks", home) >= cached, 10,
               "the router's mirror of the home group's prefix cache")
    before = {g: w.Stats(worker_pb2.StatsRequest()).prefix_cache_hits for g, w in stack.workers.items()}
    groups = [stack.client.completions.create(model="tiny", prompt=system + [i, i], max_tokens=2, temperature=0)
              .replica_group_id for i in range(2, 8)]
    assert groups == [home] * 6
    hits = {g: w.Stats(worker_pb2.StatsRequest()).prefix_cache_hits - before[g] for g, w in stack.workers.items()}
    assert hits == {home: 6 * 64, other: 0}


# ---- equal to the worker's greedy output --------------------------------------------------


def test_grpc_stream_equals_the_workers_greedy_stream(stack):
    prompt = list(range(20, 36))
    responses = generate(stack, ids=prompt, max_tokens=120, temperature=0, ignore_eos=True)
    tokens, final = responses[:-1], responses[-1]
    group = final.replica_group_id
    assert {r.replica_group_id for r in responses} == {group} and group in stack.workers
    assert len({r.request_id for r in responses}) == 1 and responses[0].request_id.startswith("rtr-")
    assert [r.token.index for r in tokens] == list(range(120))
    ids, text = worker_greedy(stack, group, prompt, 120, ignore_eos=True)
    assert [r.token.token_id for r in tokens] == ids
    deltas = [r.token.text for r in tokens]
    assert "".join(deltas) == text
    assert not any(d.endswith("\ufffd") for d in deltas)  # a character is never split across messages
    assert final.finished.finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert (final.finished.usage.prompt_tokens, final.finished.usage.completion_tokens) == (16, 120)
    assert final.finished.timings.total_ns >= final.finished.timings.time_to_first_token_ns > 0


def test_openai_completions_equal_the_worker(stack):
    prompt = "The capital of France is"
    prompt_ids = Tokenizer.from_file(str(stack.model_dir / "tokenizer.json")).encode(prompt).ids
    ids = len(prompt_ids)
    out = stack.client.completions.create(model="tiny", prompt=prompt, max_tokens=24, temperature=0)
    _, text = worker_greedy(stack, out.replica_group_id, prompt_ids, 24)
    assert out.choices[0].text == text
    assert out.object == "text_completion" and out.model == "tiny"
    assert (out.usage.prompt_tokens, out.usage.completion_tokens, out.usage.total_tokens) == (ids, 24, ids + 24)
    chunks = list(stack.client.completions.create(model="tiny", prompt=prompt, max_tokens=24, temperature=0,
                                                  stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 24


def test_openai_chat_equals_the_worker_on_the_chat_templates_ids(stack):
    from transformers import AutoTokenizer

    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a color."}]
    reference = AutoTokenizer.from_pretrained(str(stack.model_dir))
    encoded = reference.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    prompt_ids = list(encoded["input_ids"] if hasattr(encoded, "keys") else encoded)
    out = stack.client.chat.completions.create(model="tiny", messages=messages, max_tokens=40, temperature=0)
    ids, text = worker_greedy(stack, out.replica_group_id, prompt_ids, 40)
    assert out.choices[0].message.role == "assistant" and out.choices[0].message.content == text
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (len(prompt_ids), len(ids))
    stream = stack.client.chat.completions.create(model="tiny", messages=messages, max_tokens=40, temperature=0,
                                                  stream=True)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == text
    assert chunks[-1].choices[0].finish_reason in ("length", "stop")
    assert {c.object for c in chunks} == {"chat.completion.chunk"}


# ---- placement ----------------------------------------------------------------------------


def test_new_requests_avoid_the_group_holding_long_requests(stack):
    wait_idle(stack)
    long = Held(stack, list(range(10, 30)), max_tokens=490)  # 510 tokens reserved
    try:
        assert long.group == FIRST  # equal loads: the lower id
        view = groups(stack)
        assert (view[FIRST].kv_bytes_reserved, view[SECOND].kv_bytes_reserved) == (510 * BPT, 0)
        placed = [generate(stack, ids=[40 + i, 41, 42], max_tokens=8, temperature=0)[-1].replica_group_id
                  for i in range(4)]
        assert placed == [SECOND] * 4
    finally:
        long.cancel()
    wait_until(lambda: all_released(stack), what="reservations released")


def test_a_group_marked_unhealthy_or_expired_in_the_store_gets_nothing_new(stack):
    fields = dict.fromkeys(rank_fields(1, 2), "healthy")
    wait_idle(stack)
    try:
        stack.store.heartbeat(FIRST, fields, ttl_s=600)
        stack.store.mark_group(FIRST, "unhealthy")
        wait_until(lambda: groups(stack)[FIRST].status == UNHEALTHY, what=f"{FIRST} unhealthy")
        models = stack.router.ListModels(router_pb2.ListModelsRequest(), metadata=AUTH).models
        assert models[0].healthy_replica_groups == 1
        placed = {generate(stack, ids=[7, 8, 9], max_tokens=4, temperature=0)[-1].replica_group_id for _ in range(3)}
        assert placed == {SECOND}
        # heartbeats that stop: the group expires from the store and is left alone too
        stack.store.heartbeat(FIRST, fields, ttl_s=1.0)
        wait_until(lambda: groups(stack)[FIRST].status == HEALTHY, what=f"{FIRST} healthy again")
        wait_until(lambda: groups(stack)[FIRST].status == UNHEALTHY, what=f"{FIRST} expired")
        assert generate(stack, ids=[7, 8, 9], max_tokens=4, temperature=0)[-1].replica_group_id == SECOND
        # the router mirrors each group's KV utilization into the store's replica_kv_util zset
        mirrored = redis.Redis.from_url(stack.redis_url).zscore("replica_kv_util", SECOND)
        assert mirrored is not None and 0.0 <= mirrored <= 1.0
    finally:
        stack.store.heartbeat(FIRST, fields, ttl_s=3600)
    wait_until(lambda: groups(stack)[FIRST].status == HEALTHY, what=f"{FIRST} healthy at the end")


# ---- bad input ----------------------------------------------------------------------------

BAD_INPUTS = [
    # (name, gRPC request kwargs, HTTP body, gRPC status, HTTP status, message fragment: one for both, or
    # the gRPC one and the HTTP one, whose body is first checked against its model in protocol.py)
    ("empty prompt", {"text": ""}, {"prompt": ""}, "INVALID_ARGUMENT", 400,
     ("prompt must not be empty", "prompt: none of its forms fits (string should have at least 1 character")),
    ("prompt beyond context", {"ids": [65] * 2100}, {"prompt": [65] * 2100}, "INVALID_ARGUMENT", 400,
     "This model's maximum context length is 2048 tokens. However, you requested 2116 tokens "
     "(2100 in the messages, 16 in the completion)"),
    ("prompt beyond every KV budget", {"ids": [65] * 700}, {"prompt": [65] * 700}, "INVALID_ARGUMENT", 400,
     "This request needs KV cache for 716 tokens (700 in the messages, 16 in the completion)"),
    ("max_tokens 0", {"ids": [5], "max_tokens": 0}, {"prompt": "a", "max_tokens": 0}, "INVALID_ARGUMENT", 400,
     "max_tokens must be an integer >= 1, got 0"),
    ("max_tokens < 0", {"ids": [5], "max_tokens": -4}, {"prompt": "a", "max_tokens": -4}, "INVALID_ARGUMENT", 400,
     ("max_tokens must be an integer >= 1, got -4", "max_tokens: input should be greater than or equal to 0, got -4")),
    ("temperature < 0", {"ids": [5], "temperature": -1.0}, {"prompt": "a", "temperature": -1.0},
     "INVALID_ARGUMENT", 400, ("temperature must be a finite number >= 0, got -1.0",
                               "temperature: input should be greater than or equal to 0, got -1.0")),
    ("top_p 0", {"ids": [5], "top_p": 0.0}, {"prompt": "a", "top_p": 0}, "INVALID_ARGUMENT", 400,
     ("top_p must be in (0, 1], got 0", "top_p: input should be greater than 0, got 0")),
    ("top_p > 1", {"ids": [5], "top_p": 1.5}, {"prompt": "a", "top_p": 1.5}, "INVALID_ARGUMENT", 400,
     ("top_p must be in (0, 1], got 1.5", "top_p: input should be less than or equal to 1, got 1.5")),
    ("unknown model", {"ids": [5], "model": "llama-9000"}, {"prompt": "a", "model": "llama-9000"}, "NOT_FOUND",
     404, "The model `llama-9000` does not exist (served: tiny)"),
    ("missing API key", {"ids": [5], "metadata": ()}, {"prompt": "a", "key": None}, "UNAUTHENTICATED", 401,
     "missing API key"),
    ("wrong API key", {"ids": [5], "metadata": (("authorization", "Bearer nope"),)},
     {"prompt": "a", "key": "nope"}, "UNAUTHENTICATED", 401, "incorrect API key provided"),
]


def test_bad_inputs_get_their_status_and_message_while_a_running_stream_is_unaffected(stack):
    prompt = list(range(100, 116))
    wait_idle(stack)
    running: list[router_pb2.RouterGenerateResponse] = []
    thread = threading.Thread(target=lambda: running.extend(
        generate(stack, ids=prompt, max_tokens=150, temperature=0, ignore_eos=True)))
    thread.start()
    wait_until(lambda: groups(stack)[FIRST].kv_bytes_reserved > 0, what="the running stream placed")
    for name, grpc_kw, body, code, http_status, fragments in BAD_INPUTS:
        fragment, http_fragment = fragments if isinstance(fragments, tuple) else (fragments, fragments)
        kw = dict(grpc_kw)
        args = {k: kw.pop(k) for k in ("ids", "text", "model", "metadata") if k in kw}
        with pytest.raises(grpc.RpcError) as caught:
            generate(stack, **args, **kw)
        assert caught.value.code().name == code, name
        assert fragment in caught.value.details(), (name, caught.value.details())
        body = dict(body)
        key = body.pop("key", API_KEY)
        response = http_post(stack, "/v1/completions", {"model": "tiny", **body}, key=key)
        assert response.status_code == http_status, (name, response.text)
        error = response.json()["error"]
        assert http_fragment in error["message"], (name, error)
        assert set(error) == {"message", "type", "param", "code"}
    with pytest.raises(openai.NotFoundError):
        stack.client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{stack.http}/v1", api_key="nope", max_retries=0).models.list()
    thread.join(60)
    ids, text = worker_greedy(stack, FIRST, prompt, 150, ignore_eos=True)
    assert [r.token.token_id for r in running[:-1]] == ids and "".join(r.token.text for r in running[:-1]) == text
    assert running[-1].finished.usage.completion_tokens == 150
    wait_until(lambda: all_released(stack), what="reservations released")


@pytest.mark.serial  # the queued request must still wait (QUEUE_TIMEOUT_S) while the next ones are refused
def test_queue_full_and_queue_deadline(stack):
    # serial: beside another worker's tests its three refusals took longer than the queued
    # request's 2 s in a fresh-clone run on the AVX2 EPYC (busy-looping neighbours had not shown it)
    # each group is filled to its last token: new requests fit a group's budget but have no headroom
    wait_idle(stack)
    held = [Held(stack, list(range(1, 21)), max_tokens=CAPACITY_TOKENS - 20) for _ in range(2)]
    queued: list[BaseException] = []
    try:
        assert sorted(h.group for h in held) == [FIRST, SECOND]
        started = time.monotonic()
        thread = threading.Thread(target=lambda: queued.extend(_raised(
            lambda: generate(stack, ids=[5] * 20, max_tokens=100, temperature=0))))
        thread.start()
        wait_until(lambda: "shardline_router_queue_depth 1.0" in httpx.get(f"{stack.http}/metrics").text,
                   what="one request queued")
        with pytest.raises(grpc.RpcError) as caught:
            generate(stack, ids=[5] * 20, max_tokens=100, temperature=0)
        assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert caught.value.details() == ("the admission queue for model 'tiny' is full (1 requests waiting for KV "
                                          "headroom, limit 1); retry later")
        response = http_post(stack, "/v1/completions", {"prompt": [5] * 20, "max_tokens": 100})
        # with the seconds since the queued request went in, and how it ended if it has: a
        # `queue_timeout` here means it had left the queue before this request came
        assert response.status_code == 429 and response.json()["error"]["code"] == "queue_full", \
            (response.json(), round(time.monotonic() - started, 2), queued)
        with pytest.raises(openai.RateLimitError):
            stack.client.completions.create(model="tiny", prompt=[5] * 20, max_tokens=100)
        thread.join(10)
        waited = time.monotonic() - started
        assert isinstance(queued[0], grpc.RpcError) and queued[0].code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "within the queue deadline of 2 s" in queued[0].details()
        assert QUEUE_TIMEOUT_S <= waited < QUEUE_TIMEOUT_S + 3
        assert all(h.call.running() or h.call.done() for h in held)
    finally:
        for h in held:
            h.cancel()
    wait_until(lambda: all_released(stack), what="reservations released")


def _raised(fn) -> list[BaseException]:
    try:
        fn()
    except BaseException as exc:  # noqa: BLE001
        return [exc]
    return []


# ---- disconnects --------------------------------------------------------------------------


def _worker_blocks(stack: Stack, group: str) -> int:
    return stack.workers[group].Stats(worker_pb2.StatsRequest()).blocks_used


def test_a_grpc_client_that_cancels_frees_the_reservation_and_the_worker_blocks(stack):
    call = stack.router.Generate(router_pb2.RouterGenerateRequest(
        token_ids=common_pb2.TokenIds(ids=list(range(50, 100))),
        sampling=sampling(temperature=0, max_tokens=400, ignore_eos=True)), metadata=AUTH)
    first = [next(call) for _ in range(5)]
    group = first[0].replica_group_id
    assert groups(stack)[group].kv_bytes_reserved == 450 * BPT and _worker_blocks(stack, group) > 0
    call.cancel()
    wait_until(lambda: all_released(stack) and _worker_blocks(stack, group) == 0, what="reservation and blocks freed")


def test_an_http_client_that_disconnects_mid_stream_frees_the_reservation_and_the_worker_blocks(stack):
    body = {"model": "tiny", "prompt": list(range(50, 100)), "max_tokens": 400, "temperature": 0,
            "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=30) as client, client.stream(
            "POST", f"{stack.http}/v1/completions", json=body, headers={"authorization": f"Bearer {API_KEY}"}) as r:
        group = r.headers["x-shardline-replica-group-id"]
        count = 0
        for line in r.iter_lines():
            count += line.startswith("data: ")
            if count == 5:
                # checked inside the loop: leaving it closes the response (httpx), i.e. disconnects
                assert groups(stack)[group].kv_bytes_reserved == 450 * BPT and _worker_blocks(stack, group) > 0
                break
    wait_until(lambda: all_released(stack) and _worker_blocks(stack, group) == 0, what="reservation and blocks freed")


def test_logprobs_come_from_the_worker(stack):
    wait_idle(stack)
    prompt_ids = list(range(60, 70))
    out = stack.client.completions.create(model="tiny", prompt=prompt_ids, max_tokens=6, temperature=0, logprobs=2)
    # ask the group that served it for the same request: the router relays the worker's numbers
    responses = list(stack.workers[out.replica_group_id].Generate(worker_pb2.GenerateRequest(
        token_ids=common_pb2.TokenIds(ids=prompt_ids), sampling=sampling(temperature=0, max_tokens=6, logprobs=2))))
    expected = [r.token.logprob for r in responses[:-1]]
    lp = out.choices[0].logprobs
    assert lp.token_logprobs == pytest.approx(expected, abs=1e-6)
    assert len(lp.tokens) == 6 and all(len(top) <= 2 for top in lp.top_logprobs)
    chat = stack.client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                                max_tokens=3, temperature=0, logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) == 3 and all(len(c.top_logprobs) == 2 for c in content)
    assert all(c.logprob <= 0 and c.bytes == list(c.token.encode()) for c in content)
