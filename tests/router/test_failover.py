"""A replica group that dies mid-stream: the router marks it and continues the request elsewhere."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import grpc

from services.common.proto import common_pb2, router_pb2, router_pb2_grpc, worker_pb2, worker_pb2_grpc
from tests.router.processes import start_service, stop, wait_serving


def children(pid: int) -> list[int]:
    """Rank processes the worker spawned (not multiprocessing's resource tracker)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            ppid = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
        except (OSError, IndexError, ValueError):
            continue
        if ppid == pid and b"resource_tracker" not in cmdline:
            found.append(int(entry))
    return found


def test_a_stream_continues_on_another_group_when_its_group_dies(tiny_model_dir, tmp_path):
    common = ["--model", str(tiny_model_dir), "--served-model-name", "tiny", "--kv-cache-gb", "0.01"]
    a, a_address = start_service("worker", [*common, "--tp", "2", "--replica-group-id", "rg-a",
                                            "--collective-timeout", "1"], tmp_path / "a.log")
    b, b_address = start_service("worker", [*common, "--replica-group-id", "rg-b"], tmp_path / "b.log")
    procs = [a, b]
    try:
        wait_serving(a, a_address, tmp_path / "a.log")
        wait_serving(b, b_address, tmp_path / "b.log")
        router, router_address = start_service("router", [
            "--model", str(tiny_model_dir), "--served-model-name", "tiny", "--worker", a_address,
            "--worker", b_address, "--http-port", "-1"], tmp_path / "router.log")
        procs.append(router)
        wait_serving(router, router_address, tmp_path / "router.log", timeout_s=30)
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
            os.kill(children(a.pid)[0], signal.SIGKILL)  # one rank of rg-a dies mid-stream
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
    finally:
        for proc in reversed(procs):
            stop(proc, timeout_s=10)
