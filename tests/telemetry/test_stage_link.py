"""An InfiniBand link flap at a pipeline stage boundary, on a real serving group.

The recovery: send/recv timeout at the PP stage boundary -> retry once, drain and re-route the
replica if it fails again. A TP1 x PP2 worker (ranks: the driver on stage 0, the sampling rank
on stage 1) with a 1 s collective timeout, its telemetry and a registry; SHARDLINE_FAULTS makes
stage 1 post one of its hidden-state receives late, so the driver's send waits on it:

- 1.5 s late, once: the send's first wait runs out, the coordinator's retry completes; the request
  finishes with the same tokens as without the fault, telemetry raises STAGE_LINK_FLAP (the group
  ``degraded``), and once the link stays quiet the group is ``healthy`` again.
- stopped for good: the retry runs out too; the group fails (STAGE_LINK_FAILURE, every rank
  ``unhealthy``), the worker stops serving and the stream ends UNAVAILABLE with the tokens so far.
"""

from __future__ import annotations

import time
import uuid

import grpc
import pytest

from services.common.health import make_health_store
from services.common.healthcheck import check
from services.common.proto import common_pb2, telemetry_pb2, worker_pb2, worker_pb2_grpc
from services.common.registry import ShardRegistry, registry_group_id
from tests.telemetry.procs import alerts_reader, query_counts, scrape, start_service, telemetry_stub, wait_until
from tests.telemetry.test_serving_telemetry import generate, kill_stopped_children, worker_flags

TIMEOUT_S = 1.0
PROMPT = [3, 1, 4, 1, 5]
# stage 1 (global rank 1) receives the hidden states once per step: its 4th receive is the 4th step's
LATE_RECV = "rank=1,op=recv,after=3,times=1,action=sleep:1.5"
# the 6th: the 3rd step of the second request (the first, of 3 tokens, lets telemetry hear from both ranks)
STALLED_RECV = "rank=1,op=recv,after=5,action=stop"


def start_group(model_dir, tmp_path, group: str, redis_url: str, faults: str):
    registry_url = f"sqlite:///{tmp_path / 'registry.db'}"
    telemetry = start_service("telemetry", tmp_path / "telemetry.log", "--window-s", "1",
                              "--sustain-windows", "2", "--redis-url", redis_url, "--registry-url", registry_url)
    worker = start_service("worker", tmp_path / "worker.log", "--model", str(model_dir),
                           *worker_flags(group, telemetry.address, 1, 2, "--collective-timeout", str(TIMEOUT_S),
                                         "--registry-url", registry_url),
                           env={"SHARDLINE_FAULTS": faults}, metrics=False)
    return telemetry, worker, registry_url


def kinds(alerts) -> list[tuple[int, int, str, str]]:
    return [(a.kind, a.new_status, a.gpu_id.split(":")[-1], a.op_type) for a in alerts]


def test_a_late_stage_link_is_retried_generation_goes_on_and_the_group_is_degraded_then_healthy(
        tiny_model_dir, tmp_path, redis_url):
    group = f"rg-flap-{uuid.uuid4().hex[:6]}"
    telemetry, worker, registry_url = start_group(tiny_model_dir, tmp_path, group, redis_url, LATE_RECV)
    alerts, _, channel = alerts_reader(telemetry.address, group)
    health = make_health_store(redis_url)
    try:
        with grpc.insecure_channel(worker.address) as wchannel:
            stub = worker_pb2_grpc.WorkerServiceStub(wchannel)
            t0 = time.monotonic()
            flapped = generate(stub, PROMPT, 8)  # its 4th step's send waits 1.5 s: past the timeout, within the retry
            took = time.monotonic() - t0
            again = generate(stub, PROMPT, 8)  # no fault any more
        assert len(flapped) == 8 and flapped == again  # the retried step carried the right hidden states
        assert 1.5 <= took < 2 * TIMEOUT_S + 1.0, took
        assert check(worker.address, timeout_s=2) == "SERVING"
        flap = wait_until(lambda: [a for a in alerts if a.kind == telemetry_pb2.ALERT_KIND_STAGE_LINK_FLAP], 10)
        assert flap, (alerts, telemetry.log.read_text()[-2000:])
        assert kinds(flap[:1]) == [(telemetry_pb2.ALERT_KIND_STAGE_LINK_FLAP, common_pb2.REPLICA_GROUP_STATUS_DEGRADED,
                                    "pp0-tp0", "send")]
        assert "timed out on " + f"{group}:pp0-tp0 after 1.00 s; the coordinator retries it once" in flap[0].message
        with ShardRegistry(registry_url) as registry:
            gid = registry_group_id(group)
            assert wait_until(lambda: registry.get_group(gid).status == "degraded", 5)
            assert wait_until(lambda: health.group_health(group).get("pp0_tp0") == "degraded", 5)
            # two quiet 1 s windows later: healthy again
            assert wait_until(lambda: registry.get_group(gid).status == "healthy", 10), alerts
            assert wait_until(lambda: health.group_health(group).get("pp0_tp0") == "healthy", 5)
        # telemetry applies an alert to the stores after handing it to the stream, which reaches this
        # test's reader thread in its own time
        assert wait_until(lambda: len(alerts) >= 2, 5), alerts
        assert kinds(alerts) == [
            (telemetry_pb2.ALERT_KIND_STAGE_LINK_FLAP, common_pb2.REPLICA_GROUP_STATUS_DEGRADED, "pp0-tp0", "send"),
            (telemetry_pb2.ALERT_KIND_STAGE_LINK_FLAP, common_pb2.REPLICA_GROUP_STATUS_HEALTHY, "pp0-tp0", "send")]
        # telemetry counted the first wait's timeout, and no other
        timeouts = {labels["op_type"]: value for labels, value in scrape(telemetry.metrics_url)[
            "shardline_collective_timeouts_total"] if labels["replica_group_id"] == group and value}
        assert timeouts == {"send": 1}
    finally:
        channel.close()
        assert worker.stop() == 0
        telemetry.stop()
        health.remove_group(group)


def test_a_stage_link_that_stays_down_after_the_retry_fails_the_group(tiny_model_dir, tmp_path, redis_url):
    group = f"rg-down-{uuid.uuid4().hex[:6]}"
    telemetry, worker, registry_url = start_group(tiny_model_dir, tmp_path, group, redis_url, STALLED_RECV)
    alerts, _, channel = alerts_reader(telemetry.address, group)
    health = make_health_store(redis_url)
    try:
        tokens: list[int] = []
        with grpc.insecure_channel(worker.address) as wchannel:
            stub = worker_pb2_grpc.WorkerServiceStub(wchannel)
            assert len(generate(stub, PROMPT, 3)) == 3
            tchannel, tstub = telemetry_stub(telemetry.address)
            with tchannel:  # telemetry knows both ranks (it marks every rank it heard from)
                assert wait_until(lambda: {gpu for gpu, _ in query_counts(tstub, group)} == {
                    f"{group}:pp0-tp0", f"{group}:pp1-tp0"}, 10)
            request = worker_pb2.GenerateRequest(token_ids=common_pb2.TokenIds(ids=PROMPT), sampling=(
                common_pb2.SamplingParameters(temperature=0, max_tokens=16, ignore_eos=True)))
            t0 = time.monotonic()
            with pytest.raises(grpc.RpcError) as failed:
                for response in stub.Generate(request, timeout=60):
                    tokens.append(response.token.token_id)
            took = time.monotonic() - t0
        assert failed.value.code() == grpc.StatusCode.UNAVAILABLE, failed.value
        assert "timed out after 1 s, and again after its retry" in failed.value.details()
        assert len(tokens) == 2  # two steps went through; the 3rd step's send never completed
        assert 2 * TIMEOUT_S <= took < 2 * TIMEOUT_S + 5.0, took
        assert wait_until(lambda: check(worker.address, timeout_s=2) == "NOT_SERVING", 5)
        failure = wait_until(lambda: [a for a in alerts if a.kind == telemetry_pb2.ALERT_KIND_STAGE_LINK_FAILURE], 10)
        assert failure, alerts
        assert kinds(alerts)[:2] == [
            (telemetry_pb2.ALERT_KIND_STAGE_LINK_FLAP, common_pb2.REPLICA_GROUP_STATUS_DEGRADED, "pp0-tp0", "send"),
            (telemetry_pb2.ALERT_KIND_STAGE_LINK_FAILURE, common_pb2.REPLICA_GROUP_STATUS_DRAINING, "pp0-tp0", "send")]
        expected = {"pp0_tp0": "unhealthy", "pp1_tp0": "unhealthy"}
        assert wait_until(lambda: health.group_health(group) == expected, 5), health.group_health(group)
        # the worker marks it dead (telemetry's draining came first, or the registry refused it after dead)
        with ShardRegistry(registry_url) as registry:
            assert wait_until(lambda: registry.get_group(registry_group_id(group)).status == "dead", 5)
    finally:
        channel.close()
        kill_stopped_children(worker.proc.pid)  # the rank this test stopped
        worker.stop()
        telemetry.stop()
        health.remove_group(group)
