"""The shipper against a real telemetry process: batches arrive, sampling keeps timeouts, a
service that starts after the shipper loses nothing, a down service costs dropped events and
never a blocked caller."""

from __future__ import annotations

import time

import pytest

from services.common.collective_events import CollectiveEvent
from services.common.proto import telemetry_pb2
from services.telemetry.client import BadSampleSpec, ShipperConfig, TelemetryShipper, parse_sample_rates
from tests.stack import free_port
from tests.telemetry.procs import query_counts, scrape, start_service, telemetry_stub, wait_until


def events(group: str, n: int, op: str = "all_reduce", *, timed_out: bool = False, gpu: str = "") -> list:
    now = int(time.time() * 1e3)
    return [CollectiveEvent(group, gpu or f"{group}:pp0-tp0", op, 1024, 0.5 + (i % 10) * 0.1, 2, now, timed_out)
            for i in range(n)]


def test_parse_sample_rates():
    assert parse_sample_rates("broadcast=0.1, all_reduce=1") == {"broadcast": 0.1, "all_reduce": 1.0}
    assert parse_sample_rates("") == {}
    for bad in ("broadcast", "broadcast=2", "=0.5", "send=x"):
        with pytest.raises(BadSampleSpec):
            parse_sample_rates(bad)


def test_events_arrive_in_batches_and_are_confirmed(telemetry):
    shipper = TelemetryShipper(ShipperConfig(telemetry.address, batch_events=500))
    for e in events("ship-a", 2300):
        shipper.record(e)
    shipper.close(timeout_s=10)
    assert shipper.stats() == {"sent": 2300, "accepted": 2300, "dropped": 0, "sampled_out": 0, "buffered": 0,
                               "stream_failures": 0}
    channel, stub = telemetry_stub(telemetry.address)
    with channel:
        assert query_counts(stub, "ship-a") == {("ship-a:pp0-tp0", "all_reduce"): 2300}
        (window,) = stub.Query(telemetry_pb2.QueryRequest(replica_group_id="ship-a")).windows
        assert window.bytes == 2300 * 1024 and 0.5 <= window.p50_ms <= 1.4 and window.p99_ms <= 1.4 * 1.01
    samples = scrape(telemetry.metrics_url)
    (count,) = [v for labels, v in samples["shardline_collective_duration_seconds_count"]
                if labels["replica_group_id"] == "ship-a"]
    assert count == 2300


def test_sampling_thins_an_op_but_keeps_every_timeout(telemetry):
    shipper = TelemetryShipper(ShipperConfig(telemetry.address, sample_rates={"broadcast": 0.1}))
    for e in events("ship-b", 1000, "broadcast") + events("ship-b", 7, "broadcast", timed_out=True) \
            + events("ship-b", 100, "all_reduce"):
        shipper.record(e)
    shipper.close(timeout_s=10)
    assert shipper.sampled_out == 900 and shipper.accepted == 100 + 7 + 100
    channel, stub = telemetry_stub(telemetry.address)
    with channel:
        windows = {w.op_type: w for w in stub.Query(telemetry_pb2.QueryRequest(replica_group_id="ship-b")).windows}
    assert (windows["broadcast"].count, windows["broadcast"].timeouts) == (107, 7)
    assert windows["all_reduce"].count == 100


def test_telemetry_that_starts_after_the_shipper_gets_every_event(tmp_path):
    """A rank and its telemetry service started together (as `shardline up` does): the first
    stream waits for the service, so what the rank recorded meanwhile (a load's barrier) arrives."""
    port = free_port()
    shipper = TelemetryShipper(ShipperConfig(f"127.0.0.1:{port}", flush_interval_s=0.05, backoff_max_s=0.5))
    for e in events("ship-f", 100):
        shipper.record(e)
    time.sleep(1.0)  # attempts would have failed and let go of the buffer by now
    service = start_service("telemetry", tmp_path / "t.log", "--window-s", "300", port=port)
    try:
        for e in events("ship-f", 100):
            shipper.record(e)
        assert wait_until(lambda: shipper.accepted == 200, 15), shipper.stats()
        assert (shipper.dropped, shipper.stream_failures) == (0, 0), shipper.stats()
    finally:
        shipper.close(timeout_s=5)
        assert service.stop() == 0


def test_down_telemetry_drops_events_and_never_blocks_the_caller():
    # connect_wait_s=0: the shipper past its start-up wait for a service still down
    config = ShipperConfig(f"127.0.0.1:{free_port()}", buffer_events=5000, batch_events=1000,
                           flush_interval_s=0.05, connect_wait_s=0.0)
    shipper = TelemetryShipper(config)
    batch = events("ship-c", 50_000)
    t0 = time.perf_counter()
    for e in batch:
        shipper.record(e)
    per_event_us = (time.perf_counter() - t0) / len(batch) * 1e6
    assert per_event_us < 50, per_event_us  # a deque append and a few counters, nothing that waits
    assert shipper.buffered <= 5000
    assert wait_until(lambda: shipper.stream_failures >= 1, 5)
    # all but the buffer and the batches the sender took before its stream failed (44,000 seen)
    assert shipper.dropped >= 40_000
    # a timeout pushes out an old event rather than being dropped
    before = shipper.dropped
    shipper.record(events("ship-c", 1, timed_out=True)[0])
    assert shipper._buffer[-1].timed_out and shipper.dropped == before + (1 if shipper.buffered == 5000 else 0)
    t0 = time.monotonic()
    shipper.close(timeout_s=3)
    assert time.monotonic() - t0 < 4
    assert shipper.accepted == 0


def test_shipper_reconnects_when_telemetry_comes_back(tmp_path):
    port = free_port()
    shipper = TelemetryShipper(ShipperConfig(f"127.0.0.1:{port}", flush_interval_s=0.05, backoff_max_s=0.5,
                                             connect_wait_s=0.0))  # past its start-up wait
    for e in events("ship-d", 100):
        shipper.record(e)
    assert wait_until(lambda: shipper.stream_failures >= 1, 5)
    service = start_service("telemetry", tmp_path / "t.log", "--window-s", "300", port=port)
    try:
        for e in events("ship-d", 100):
            shipper.record(e)
        assert wait_until(lambda: shipper.accepted >= 100, 15), shipper.stats()
        shipper.close(timeout_s=5)
        assert shipper.accepted + shipper.dropped == 200
        # the first 100 predate the service's first window, so count them in the cumulative metrics
        (count,) = [v for labels, v in scrape(service.metrics_url)["shardline_collective_duration_seconds_count"]
                    if labels["replica_group_id"] == "ship-d"]
        assert count == shipper.accepted
    finally:
        assert service.stop() == 0


@pytest.mark.serial  # times record() and counts what the sender thread got onto the stream meanwhile
def test_a_stalled_telemetry_process_costs_drops_not_waits(tmp_path):
    import signal

    service = start_service("telemetry", tmp_path / "t.log", "--window-s", "300", metrics=False)
    shipper = TelemetryShipper(ShipperConfig(service.address, buffer_events=2000, batch_events=500,
                                             flush_interval_s=0.05, stream_max_s=1.0))
    try:
        for e in events("ship-e", 200):
            shipper.record(e)
        assert wait_until(lambda: shipper.accepted == 200, 10), shipper.stats()
        service.proc.send_signal(signal.SIGSTOP)  # alive, connected, not reading: "slow"
        t0 = time.perf_counter()
        for e in events("ship-e", 20_000):
            shipper.record(e)
        assert (time.perf_counter() - t0) / 20_000 * 1e6 < 50
        assert shipper.dropped >= 20_000 - 2000 - 1000  # the buffer, plus what the stalled stream took
        assert shipper.buffered <= 2000
    finally:
        service.proc.send_signal(signal.SIGCONT)
        shipper.close(timeout_s=5)
        assert service.stop() == 0
