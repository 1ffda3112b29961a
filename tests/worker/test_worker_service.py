"""WorkerService over real gRPC on loopback, served by a real `shardline serve worker` group."""

from __future__ import annotations

import os
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from services.common.fork_server import ForkedProcess
from services.common.healthcheck import check, wait_serving
from services.common.proto import common_pb2, worker_pb2, worker_pb2_grpc
from tests import forks
from tests.stack import free_port
from tests.worker.oracle import reference_greedy, reference_logprobs

REPO = Path(__file__).resolve().parents[2]


def start_worker(model_dir: Path, log: Path, *flags: str,
                 env: dict | None = None) -> tuple[subprocess.Popen | ForkedProcess, str]:
    port = free_port()
    proc = forks.start(["serve", "worker", "--model", str(model_dir), "--port", str(port), *flags], log,
                       {**os.environ, **(env or {})}, forked=not env)
    address = f"127.0.0.1:{port}"
    problem = wait_serving(proc, address, timeout_s=90)
    if problem:
        proc.kill()
        pytest.fail(f"worker {problem}:\n{log.read_text()}")
    return proc, address


def stop_worker(proc: subprocess.Popen) -> int:
    proc.terminate()
    try:
        return proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait()


@pytest.fixture(scope="module")
def worker(tiny_model_dir, tmp_path_factory) -> Iterator[worker_pb2_grpc.WorkerServiceStub]:
    # 40 blocks of 16 = 640 tokens: small enough to test the budget, large enough for 16 streams
    proc, address = start_worker(tiny_model_dir, tmp_path_factory.mktemp("worker") / "worker.log",
                                 "--tp", "2", "--kv-cache-gb", str(40 * 16 * 2048 / 2**30))
    channel = grpc.insecure_channel(address)
    yield worker_pb2_grpc.WorkerServiceStub(channel)
    channel.close()
    assert stop_worker(proc) == 0


def sampling(**kw) -> common_pb2.SamplingParameters:
    return common_pb2.SamplingParameters(**kw)


def wait_blocks_free(stub, timeout_s: float = 3.0) -> worker_pb2.StatsResponse:
    deadline = time.monotonic() + timeout_s
    while True:
        stats = stub.Stats(worker_pb2.StatsRequest())
        if stats.blocks_used == 0 or time.monotonic() > deadline:
            return stats
        time.sleep(0.05)


def test_stats_reports_the_kv_budget(worker):
    stats = worker.Stats(worker_pb2.StatsRequest())
    assert (stats.blocks_total, stats.block_size, stats.blocks_used) == (40, 16, 0)
    assert stats.layout.tp_degree == 2 and stats.layout.pp_degree == 1
    # 2 · 4 layers · 2 KV heads per rank · 32 · 4 bytes
    assert stats.kv_bytes_per_token == 2 * 4 * 2 * 32 * 4
    assert stats.kv_bytes_capacity == 40 * 16 * stats.kv_bytes_per_token


def test_tokens_stream_one_by_one_and_match_transformers(worker, tiny_model_dir):
    prompt = [5, 80, 200, 31, 7, 99]
    arrivals, ids = [], []
    responses = list(worker.Generate(worker_pb2.GenerateRequest(
        token_ids=common_pb2.TokenIds(ids=prompt), sampling=sampling(temperature=0, max_tokens=20, ignore_eos=True))))
    for r in responses[:-1]:
        assert r.WhichOneof("event") == "token"
        ids.append(r.token.token_id)
    assert [r.token.index for r in responses[:-1]] == list(range(20))
    final = responses[-1].finished
    assert final.finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert (final.usage.prompt_tokens, final.usage.completion_tokens) == (6, 20)
    assert ids == reference_greedy(tiny_model_dir, prompt, 20)
    # one message per token, as they are produced: the first arrives long before the last
    stream = worker.Generate(worker_pb2.GenerateRequest(
        token_ids=common_pb2.TokenIds(ids=prompt), sampling=sampling(temperature=0, max_tokens=60, ignore_eos=True)))
    for _ in stream:
        arrivals.append(time.monotonic())
    assert len(arrivals) == 61 and arrivals[-1] - arrivals[0] > 0.05


def test_cancel_frees_blocks(worker):
    stream = worker.Generate(worker_pb2.GenerateRequest(
        token_ids=common_pb2.TokenIds(ids=list(range(10, 60))),
        sampling=sampling(temperature=0, max_tokens=400, ignore_eos=True)))
    for i, _ in enumerate(stream):
        if i == 3:
            assert worker.Stats(worker_pb2.StatsRequest()).blocks_used > 0
            stream.cancel()
            break
    assert wait_blocks_free(worker).blocks_used == 0


def test_sixteen_concurrent_streams_complete(worker):
    results: dict[int, list] = {}

    def run(i: int) -> None:
        results[i] = list(worker.Generate(worker_pb2.GenerateRequest(
            token_ids=common_pb2.TokenIds(ids=[4 + i, 50, 60 + i]),
            sampling=sampling(temperature=0.7, seed=i, max_tokens=16, ignore_eos=True))))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert sorted(results) == list(range(16))
    for responses in results.values():
        assert len(responses) == 17 and responses[-1].finished.usage.completion_tokens == 16
    assert wait_blocks_free(worker).blocks_used == 0


def test_reserve_kv_admits_only_what_fits_beside_the_admitted_claims(worker):
    """The group's own admission, exact whoever sends: a claim is (prompt + max_tokens) tokens
    of KV; 640 tokens fit, so a running 3 + 400 claim leaves room for 237 more and no more."""
    bpt = worker.Stats(worker_pb2.StatsRequest()).kv_bytes_per_token
    running = worker.Generate(worker_pb2.GenerateRequest(
        token_ids=common_pb2.TokenIds(ids=[9, 8, 7]), reserve_kv=True,
        sampling=sampling(temperature=0, max_tokens=400, ignore_eos=True)))
    next(running)
    stats = worker.Stats(worker_pb2.StatsRequest())
    assert stats.kv_bytes_admitted == 403 * bpt
    with pytest.raises(grpc.RpcError) as caught:  # 3 + 235 = 238 tokens: one too many
        list(worker.Generate(worker_pb2.GenerateRequest(
            token_ids=common_pb2.TokenIds(ids=[1, 2, 3]), reserve_kv=True, sampling=sampling(max_tokens=235))))
    assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert caught.value.details().startswith("KV budget full")
    fits = list(worker.Generate(worker_pb2.GenerateRequest(
        token_ids=common_pb2.TokenIds(ids=[1, 2, 3]), reserve_kv=True,
        sampling=sampling(temperature=0, max_tokens=234, ignore_eos=True))))
    assert fits[-1].finished.usage.completion_tokens == 234
    # without reserve_kv a request is counted, never refused (the scheduler queues it)
    unreserved = list(worker.Generate(worker_pb2.GenerateRequest(
        token_ids=common_pb2.TokenIds(ids=[1, 2, 3]), sampling=sampling(temperature=0, max_tokens=300))))
    assert unreserved[-1].HasField("finished")
    running.cancel()
    stats = wait_blocks_free(worker)
    assert stats.kv_bytes_admitted == 0 and stats.kv_budget_refusals == 1
    assert stats.kv_bytes_admitted_peak >= 640 * bpt


@pytest.mark.parametrize(("request_kwargs", "field"), [
    (dict(text=""), "text must not be empty"),
    (dict(text="hi", sampling=common_pb2.SamplingParameters(max_tokens=0)), "max_tokens"),
    (dict(text="hi", sampling=common_pb2.SamplingParameters(temperature=-1)), "temperature"),
    (dict(text="hi", sampling=common_pb2.SamplingParameters(top_p=0)), "top_p"),
    (dict(text="hi", sampling=common_pb2.SamplingParameters(top_p=1.5)), "top_p"),
    (dict(text="hi", sampling=common_pb2.SamplingParameters(max_tokens=700)), "KV cache holds 40 blocks"),
    (dict(text="hi", sampling=common_pb2.SamplingParameters(first_step=2**32 - 1, max_tokens=8)),
     "first_step + max_tokens must be at most 2**32 - 1"),
])
def test_bad_requests_are_invalid_argument_and_do_not_disturb_running_ones(worker, request_kwargs, field):
    running = worker.Generate(worker_pb2.GenerateRequest(
        token_ids=common_pb2.TokenIds(ids=[9, 8, 7]), sampling=sampling(temperature=0, max_tokens=30, ignore_eos=True)))
    first = next(running)
    with pytest.raises(grpc.RpcError) as caught:
        list(worker.Generate(worker_pb2.GenerateRequest(**request_kwargs)))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in caught.value.details()
    rest = list(running)
    assert first.token.index == 0 and len(rest) == 30 and rest[-1].finished.usage.completion_tokens == 30


def test_score_matches_transformers(worker, tiny_model_dir):
    ids = list(range(20, 90))
    response = worker.Score(worker_pb2.ScoreRequest(token_ids=common_pb2.TokenIds(ids=ids)))
    ref = reference_logprobs(tiny_model_dir, ids)
    assert response.n_tokens == 70 and len(response.logprobs) == 69
    assert max(abs(a - b) for a, b in zip(response.logprobs, ref.tolist())) <= 1e-4


def test_drain_stops_admission(tiny_model_dir, tmp_path):
    proc, address = start_worker(tiny_model_dir, tmp_path / "w.log", "--kv-cache-gb", "0.01")
    try:
        with grpc.insecure_channel(address) as channel:
            stub = worker_pb2_grpc.WorkerServiceStub(channel)
            assert stub.Drain(worker_pb2.DrainRequest(timeout_ns=10**9)).drained
            with pytest.raises(grpc.RpcError) as caught:
                list(stub.Generate(worker_pb2.GenerateRequest(text="hi")))
            assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
            assert stub.Stats(worker_pb2.StatsRequest()).draining
    finally:
        assert stop_worker(proc) == 0


def test_dead_rank_fails_streams_with_unavailable_and_the_tokens_so_far(tiny_model_dir, tmp_path):
    # rank 1 dies at its 200th all-gather (8 row-parallel, 1 logits a step): mid-stream
    proc, address = start_worker(tiny_model_dir, tmp_path / "w.log", "--tp", "2", "--kv-cache-gb", "0.01",
                                 env={"SHARDLINE_FAULTS": "rank=1,op=all_gather,after=200,action=kill"})
    try:
        with grpc.insecure_channel(address) as channel:
            stub = worker_pb2_grpc.WorkerServiceStub(channel)
            got = []
            stream = stub.Generate(worker_pb2.GenerateRequest(
                token_ids=common_pb2.TokenIds(ids=[5, 6, 7]), sampling=sampling(temperature=0, max_tokens=200,
                                                                                 ignore_eos=True)))
            with pytest.raises(grpc.RpcError) as caught:
                for response in stream:
                    got.append(response.token.token_id)
            assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "unhealthy" in caught.value.details()
            assert 0 < len(got) < 200
            deadline = time.monotonic() + 5
            while check(address) != "NOT_SERVING" and time.monotonic() < deadline:
                time.sleep(0.1)
            assert check(address) == "NOT_SERVING"
    finally:
        stop_worker(proc)
