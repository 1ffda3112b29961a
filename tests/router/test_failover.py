"""A replica group that dies mid-stream: the router marks it and continues the request elsewhere,
with the tokens of a fault-free run (greedy, and sampled with a seed)."""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import grpc
import pytest

from services.common.proto import common_pb2, router_pb2, router_pb2_grpc, worker_pb2, worker_pb2_grpc
from tests.ranks import rank_pids
from tests.router.processes import start_service, stop, wait_serving


@contextmanager
def two_groups(tiny_model_dir: Path, tmp_path: Path, *, flags: tuple[str, ...] = (),
               b_layout: tuple[str, ...] = ()) -> Iterator[tuple[subprocess.Popen, str, str]]:
    """rg-a (TP 2, whose rank a test kills) and rg-b (TP 1, or ``b_layout``) behind a router, both
    with ``flags``: rg-a's worker process, rg-b's address, the router's address."""
    common = ["--model", str(tiny_model_dir), "--served-model-name", "tiny", "--kv-cache-gb", "0.01", *flags]
    a, a_address = start_service("worker", [*common, "--tp", "2", "--replica-group-id", "rg-a",
                                            "--collective-timeout", "1"], tmp_path / "a.log")
    b, b_address = start_service("worker", [*common, *b_layout, "--replica-group-id", "rg-b"], tmp_path / "b.log")
    procs = [a, b]
    try:
        wait_serving(a, a_address, tmp_path / "a.log")
        wait_serving(b, b_address, tmp_path / "b.log")
        router, router_address = start_service("router", [
            "--model", str(tiny_model_dir), "--served-model-name", "tiny", "--worker", a_address,
            "--worker", b_address, "--http-port", "-1"], tmp_path / "router.log")
        procs.append(router)
        wait_serving(router, router_address, tmp_path / "router.log", timeout_s=30)
        yield a, b_address, router_address
    finally:
        for proc in reversed(procs):
            stop(proc, timeout_s=10)


def test_a_stream_continues_on_another_group_when_its_group_dies(tiny_model_dir, tmp_path):
    with two_groups(tiny_model_dir, tmp_path) as (a, b_address, router_address):
        prompt = list(range(30, 46))
        params = common_pb2.SamplingParameters(temperature=0, max_tokens=200, ignore_eos=True)
        with grpc.insecure_channel(b_address) as channel:
            reference = [r.token.token_id for r in worker_pb2_grpc.WorkerServiceStub(channel).Generate(
                worker_pb2.GenerateRequest(token_ids=common_pb2.TokenIds(ids=prompt), sampling=params))
                if r.HasField("token")]
        with grpc.insecure_channel(router_address) as channel:
            stub = router_pb2_grpc.RouterServiceStub(channel)
            stream = stub.Generate(router_pb2.RouterGenerateRequest(token_ids=common_pb2.TokenIds(ids=prompt),
                                                                    sampling=params))
            responses = [next(stream) for _ in range(10)]
            assert {r.replica_group_id for r in responses} == {"rg-a"}  # equal loads: the lower id
            os.kill(rank_pids(a.pid)[0], signal.SIGKILL)  # one rank of rg-a dies mid-stream
            responses += list(stream)
            groups = {g.replica_group_id: g for g in
                      stub.ListReplicaGroups(router_pb2.ListReplicaGroupsRequest()).groups}
        tokens, final = responses[:-1], responses[-1]
        assert [r.token.index for r in tokens] == list(range(200))
        assert [r.token.token_id for r in tokens] == reference  # greedy: the same tokens as one group
        assert responses[0].replica_group_id == "rg-a" and final.replica_group_id == "rg-b"
        assert final.finished.finish_reason == common_pb2.FINISH_REASON_LENGTH
        assert (final.finished.usage.prompt_tokens, final.finished.usage.completion_tokens) == (16, 200)
        assert groups["rg-a"].status == common_pb2.REPLICA_GROUP_STATUS_UNHEALTHY
        assert groups["rg-a"].kv_bytes_reserved == 0 and groups["rg-b"].kv_bytes_reserved == 0
        assert "continuing elsewhere" in (tmp_path / "router.log").read_text()


BF16 = ("--dtype", "bfloat16")  # in the default numerics, layout-invariant


@pytest.mark.parametrize(("flags", "b_layout"), [((), ()), (BF16, ("--pp", "2"))],
                         ids=["float32-tp2-to-tp1", "bfloat16-layout-invariant-tp2-to-pp2"])
def test_a_seeded_sampled_stream_continued_elsewhere_has_the_fault_free_tokens(tiny_model_dir, tmp_path, flags,
                                                                             b_layout):
    """The continuation carries the sampling step (first_step = the tokens streamed before the
    failure), so rg-b draws the rest of the seeded stream that rg-a would have drawn. In bfloat16
    that needs the same bits on both plans: the layout-invariant numerics (the default), across
    TP2 and PP2, whose kernels are batch-invariant too (float32's are not: a continuation prefills
    what the fault-free run decoded, so its logprobs may differ in the last bits)."""
    max_tokens = 64
    with two_groups(tiny_model_dir, tmp_path, flags=flags, b_layout=b_layout) as (a, b_address, router_address):
        prompt = list(range(50, 62))
        params = common_pb2.SamplingParameters(temperature=0.8, seed=31337, max_tokens=max_tokens, ignore_eos=True)

        def on_b_with_logprobs(ids: list[int], sampling: common_pb2.SamplingParameters) -> list[tuple[int, float]]:
            with grpc.insecure_channel(b_address) as channel:
                return [(r.token.token_id, r.token.logprob) for r in worker_pb2_grpc.WorkerServiceStub(
                    channel).Generate(worker_pb2.GenerateRequest(token_ids=common_pb2.TokenIds(ids=ids),
                                                                 sampling=sampling)) if r.HasField("token")]

        def on_b(ids: list[int], sampling: common_pb2.SamplingParameters) -> list[int]:
            return [token for token, _ in on_b_with_logprobs(ids, sampling)]

        fault_free = on_b_with_logprobs(prompt, params)
        reference = [token for token, _ in fault_free]
        with grpc.insecure_channel(router_address) as channel:
            stream = router_pb2_grpc.RouterServiceStub(channel).Generate(
                router_pb2.RouterGenerateRequest(token_ids=common_pb2.TokenIds(ids=prompt), sampling=params))
            responses = [next(stream) for _ in range(2)]
            assert {r.replica_group_id for r in responses} == {"rg-a"}  # equal loads: the lower id
            os.kill(rank_pids(a.pid)[0], signal.SIGKILL)  # one rank of rg-a dies mid-stream
            responses += list(stream)
        tokens, final = responses[:-1], responses[-1]
        switch = [r.replica_group_id for r in tokens].index("rg-b")  # rg-b's first token
        assert 2 <= switch < max_tokens and {r.replica_group_id for r in tokens[switch:]} == {"rg-b"}
        assert [r.token.index for r in tokens] == list(range(max_tokens))
        assert [r.token.token_id for r in tokens] == reference
        if "bfloat16" in flags:  # the same bits on both plans: every logprob too, TP2's and PP2's
            assert [r.token.logprob for r in tokens] == [logprob for _, logprob in fault_free]
        assert final.finished.finish_reason == common_pb2.FINISH_REASON_LENGTH
        assert final.finished.usage.completion_tokens == max_tokens
        # what rg-b would have sent had the step index restarted at 0: another stream
        restart = common_pb2.SamplingParameters(temperature=0.8, seed=31337, max_tokens=max_tokens - switch,
                                                ignore_eos=True)
        assert on_b(prompt + reference[:switch], restart) != reference[switch:]
        print(f"\nrg-a streamed {switch} of {max_tokens} tokens before its rank was killed")


def test_a_guided_stream_continued_elsewhere_keeps_its_grammar(tiny_model_dir, tmp_path):
    """Structured outputs across a failure: rg-b's matcher replays the tokens rg-a streamed, so the
    rest follows the schema and equals the fault-free run (seeded sampling, random weights)."""
    import json

    schema = {"type": "object", "properties": {"xs": {"type": "array", "items": {"type": "integer", "minimum": 0,
                                                                                "maximum": 9},
                                                      "minItems": 12, "maxItems": 12}},
              "required": ["xs"], "additionalProperties": False}
    params = common_pb2.SamplingParameters(temperature=1.0, seed=7, max_tokens=80,
                                           guide=common_pb2.GuidedDecoding(kind="json_schema",
                                                                           spec=json.dumps(schema)))
    prompt = list(range(70, 80))
    with two_groups(tiny_model_dir, tmp_path) as (a, b_address, router_address):
        with grpc.insecure_channel(b_address) as channel:
            reference = [r.token for r in worker_pb2_grpc.WorkerServiceStub(channel).Generate(
                worker_pb2.GenerateRequest(token_ids=common_pb2.TokenIds(ids=prompt), sampling=params))
                if r.HasField("token")]
        with grpc.insecure_channel(router_address) as channel:
            stream = router_pb2_grpc.RouterServiceStub(channel).Generate(
                router_pb2.RouterGenerateRequest(token_ids=common_pb2.TokenIds(ids=prompt), sampling=params))
            responses = [next(stream) for _ in range(3)]
            assert {r.replica_group_id for r in responses} == {"rg-a"}
            os.kill(rank_pids(a.pid)[0], signal.SIGKILL)  # one rank of rg-a dies mid-stream
            responses += list(stream)
        tokens, final = responses[:-1], responses[-1]
        assert "rg-b" in {r.replica_group_id for r in tokens}
        assert [r.token.token_id for r in tokens] == [t.token_id for t in reference]
        text = "".join(r.token.text for r in tokens)
        assert len(json.loads(text)["xs"]) == 12 and final.finished.finish_reason == common_pb2.FINISH_REASON_EOS_TOKEN
