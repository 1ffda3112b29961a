"""A Relay stream that stays idle between requests survives the keepalive pings a router sends
on it (tests/worker/test_relay.py has the rest of the Relay stream)."""

from __future__ import annotations

import time

import grpc
import pytest

from services.common.proto import worker_pb2_grpc
from tests.worker.test_relay import Relay
from tests.worker.test_worker_service import start_worker, stop_worker

pytestmark = pytest.mark.waits  # on an idle stream's keepalive pings, 20 s of sleep (tests/lanes.py)


@pytest.mark.slow  # 20 s of an idle stream: a ping-strike GOAWAY needs three pings to build up
def test_an_idle_relay_stream_survives_keepalive_pings(tiny_model_dir, tmp_path):
    # a router pings its worker channels (services/router/worker_client.py); grpc's default server
    # policy answers pings on a stream without data with GOAWAY after two strikes, which broke an
    # idle Relay stream (and failed over whatever was submitted as it went)
    options = [("grpc.keepalive_time_ms", 6_000), ("grpc.keepalive_timeout_ms", 5_000),
               ("grpc.keepalive_permit_without_calls", 1), ("grpc.http2.max_pings_without_data", 0)]
    proc, address = start_worker(tiny_model_dir, tmp_path / "worker.log")
    try:
        _idle_between_requests(address, options)
    finally:
        assert stop_worker(proc) == 0


def _idle_between_requests(address: str, options: list) -> None:
    with grpc.insecure_channel(address, options=options) as channel:
        stub = worker_pb2_grpc.WorkerServiceStub(channel)
        relay = Relay(stub)
        relay.greedy(1, [5, 6, 7], 2)
        relay.until_done(1)
        time.sleep(20)  # three pings, nothing else on the stream: grpc's default policy would GOAWAY at the third
        relay.greedy(2, [5, 6, 7], 2)
        relay.until_done(2)
        assert relay.outcomes[2].final.HasField("finished") and relay.outcomes[2].tokens == relay.outcomes[1].tokens
        relay.outbox.put(None)
        assert list(relay.call) == []
