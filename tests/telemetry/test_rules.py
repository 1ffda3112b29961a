"""Alert rules on synthetic telemetry, and their effects on real Redis and a real registry."""

from __future__ import annotations

import random
import time
import uuid

import pytest

from services.common.collective_events import CollectiveEvent
from services.common.group_status import GroupStatus
from services.common.health import make_health_store
from services.common.registry import ShardRegistry, registry_group_id
from services.telemetry.effects import GroupStatusEffects
from services.telemetry.pipeline import PipelineConfig, TelemetryPipeline
from services.telemetry.rules import AlertKind, RuleConfig
from services.telemetry.windows import WindowConfig

pytestmark = pytest.mark.waits  # on alert windows (tests/lanes.py)

ORIGIN = 1_700_000_000_000
RANKS = [(pp, tp) for pp in range(2) for tp in range(2)]


class Clock:
    def __init__(self) -> None:
        self.now = ORIGIN

    def __call__(self) -> int:
        return self.now


def make_pipeline(clock: Clock, effects=None, **rules) -> TelemetryPipeline:
    config = PipelineConfig(windows=WindowConfig(window_s=1.0, retain_windows=4),
                            rules=RuleConfig(min_events=10, min_excess_ms=1.0, **rules), close_grace_s=0.2)
    return TelemetryPipeline(config, effects=effects, clock_ms=clock)


def window_of_traffic(group: str, window: int, slow_ms: dict[tuple[int, int], float], rng: random.Random,
                      n: int = 40) -> list[CollectiveEvent]:
    events = []
    for pp, tp in RANKS:
        for i in range(n):
            base = slow_ms.get((pp, tp), 0.0)
            events.append(CollectiveEvent(group, f"{group}:pp{pp}-tp{tp}", "all_reduce", 4096,
                                          base + rng.uniform(0.1, 0.3), 2, ORIGIN + window * 1000 + i * 20, False))
    return events


def run_windows(pipeline: TelemetryPipeline, clock: Clock, group: str, slow: dict, first: int, last: int,
                rng: random.Random) -> list:
    alerts = []
    for window in range(first, last):
        pipeline.ingest(window_of_traffic(group, window, slow, rng))
        clock.now = ORIGIN + (window + 1) * 1000 + 300  # the window has ended, grace passed
        alerts += pipeline.tick()
    return alerts


def test_a_straggler_is_named_after_sustained_windows_and_recovers():
    clock, rng = Clock(), random.Random(0)
    pipeline = make_pipeline(clock)
    assert run_windows(pipeline, clock, "rg", {}, 0, 4, rng) == []  # healthy: baseline learned
    # pp0-tp1 arrives 40 ms late at every all-reduce: its TP peer pp0-tp0 waits those 40 ms
    alerts = run_windows(pipeline, clock, "rg", {(0, 0): 40.0}, 4, 7, rng)
    assert len(alerts) == 1, alerts
    (alert,) = alerts
    assert (alert.kind, alert.gpu_id, alert.new_status) == (AlertKind.SLOW_RANK, "rg:pp0-tp1", GroupStatus.DEGRADED)
    assert alert.observed_p99_ms > 40 and alert.baseline_p99_ms < 0.5
    assert "3 consecutive 1 s windows" in alert.message
    assert run_windows(pipeline, clock, "rg", {(0, 0): 40.0}, 7, 9, rng) == []  # no repeat while degraded
    recovered = run_windows(pipeline, clock, "rg", {}, 9, 12, rng)
    assert [(a.gpu_id, a.new_status) for a in recovered] == [("rg:pp0-tp1", GroupStatus.HEALTHY)]


def test_a_straggler_whose_own_waits_rise_too_is_still_named():
    clock, rng = Clock(), random.Random(4)
    pipeline = make_pipeline(clock)
    run_windows(pipeline, clock, "rg", {}, 0, 4, rng)
    # pp0-tp1 sleeps 60 ms before its all-reduces, and on a busy host it also waits ~8 ms on pp0-tp0:
    # both are elevated against the baseline, but pp0-tp1 waits far less than its peer
    alerts = run_windows(pipeline, clock, "rg", {(0, 0): 60.0, (0, 1): 8.0}, 4, 7, rng)
    assert [(a.kind, a.gpu_id) for a in alerts] == [(AlertKind.SLOW_RANK, "rg:pp0-tp1")]
    assert "its TP peers wait on it" in alerts[0].message


def test_not_sustained_long_enough_raises_nothing():
    clock, rng = Clock(), random.Random(1)
    pipeline = make_pipeline(clock, sustain_windows=3)
    run_windows(pipeline, clock, "rg", {}, 0, 3, rng)
    assert run_windows(pipeline, clock, "rg", {(0, 0): 40.0}, 3, 5, rng) == []
    assert run_windows(pipeline, clock, "rg", {}, 5, 6, rng) == []
    assert run_windows(pipeline, clock, "rg", {(0, 0): 40.0}, 6, 8, rng) == []


def test_a_slow_link_on_a_whole_stage_names_its_worst_rank_against_the_learned_baseline():
    clock, rng = Clock(), random.Random(2)
    pipeline = make_pipeline(clock)
    run_windows(pipeline, clock, "rg", {}, 0, 3, rng)
    # every rank of stage 1 is slow (a degraded link); stage 0 stays at the baseline
    alerts = run_windows(pipeline, clock, "rg", {(1, 0): 20.0, (1, 1): 25.0}, 3, 6, rng)
    assert [(a.kind, a.gpu_id) for a in alerts] == [(AlertKind.SLOW_RANK, "rg:pp1-tp1")]


def test_noise_below_the_excess_floor_is_ignored():
    clock, rng = Clock(), random.Random(3)
    pipeline = make_pipeline(clock)
    # 0.8 ms is more than 3x the ~0.2 ms baseline but less than min_excess_ms=1 above it
    assert run_windows(pipeline, clock, "rg", {(0, 0): 0.8}, 0, 8, rng) == []


def test_timeouts_alert_once_per_group_and_kind():
    clock = Clock()
    pipeline = make_pipeline(clock)
    ok = [CollectiveEvent("rg", f"rg:pp{pp}-tp{tp}", "all_reduce", 8, 0.2, 2, ORIGIN + 10, False) for pp, tp in RANKS]
    pipeline.ingest(ok)
    hung = CollectiveEvent("rg", "rg:pp0-tp0", "all_reduce", 8, 2000.0, 2, ORIGIN + 2500, True)
    sub = pipeline.subscribe("rg")
    pipeline.ingest([hung, hung])
    first = sub.get(1.0)
    assert first.kind is AlertKind.COLLECTIVE_TIMEOUT and first.new_status is GroupStatus.UNHEALTHY
    assert first.gpu_id == "rg:pp0-tp0" and "timed out on rg:pp0-tp0 after 2.00 s" in first.message
    assert set(first.group_gpu_ids) == {f"rg:pp{pp}-tp{tp}" for pp, tp in RANKS}
    # the other ranks' last events ended before the hung all-reduce began
    assert "not heard from since it began: rg:pp0-tp1, rg:pp1-tp0, rg:pp1-tp1" in first.message
    link = CollectiveEvent("rg", "rg:pp1-tp0", "recv", 8, 2000.0, 2, ORIGIN + 2600, True)
    pipeline.ingest([link, link])  # a send/recv timeout, then its retry's (no flap alert: the group has failed)
    second = sub.get(1.0)
    assert second.kind is AlertKind.STAGE_LINK_FAILURE and second.new_status is GroupStatus.DRAINING
    assert sub.get(0.2) is None
    # a late subscriber gets the retained alerts
    assert [a.kind for a in _drain(pipeline.subscribe("rg"))] == [AlertKind.COLLECTIVE_TIMEOUT,
                                                                  AlertKind.STAGE_LINK_FAILURE]
    assert list(_drain(pipeline.subscribe("other-group"))) == []


def test_a_peer_that_left_the_previous_collective_with_the_hung_rank_counts_as_silent():
    # ranks leave a collective together and the next is issued a fraction of a millisecond later,
    # so the peer's last event can end in the same whole millisecond the timed-out op began, or a
    # few after it on busy cores: still "not heard from since it began"; a peer seen half-way
    # through the wait is not
    clock = Clock()
    pipeline = make_pipeline(clock)
    began = ORIGIN + 1000
    pipeline.ingest([CollectiveEvent("rg", "rg:pp0-tp1", "all_reduce", 8, 0.2, 2, began + 3, False),
                     CollectiveEvent("rg", "rg:pp1-tp0", "all_reduce", 8, 0.2, 2, began + 750, False)])
    sub = pipeline.subscribe("rg")
    pipeline.ingest([CollectiveEvent("rg", "rg:pp0-tp0", "all_reduce", 8, 1500.0, 2, began + 1500, True)])
    alert = sub.get(1.0)
    assert alert.kind is AlertKind.COLLECTIVE_TIMEOUT
    assert alert.message.endswith("not heard from since it began: rg:pp0-tp1"), alert.message


def test_a_peer_on_the_communicator_is_judged_by_the_ops_it_finished_not_by_its_clock():
    # tp1 was descheduled as it left op 60 and stamped its end 40 ms after tp0 issued op 61; it
    # never finished 61, so it is silent. tp2 finished op 61 (tp0 waits on tp1 only) but its clock
    # runs 200 ms behind: not silent. pp1-tp0 (another stage's TP group) is judged by its clock.
    clock = Clock()
    pipeline = make_pipeline(clock)
    began = ORIGIN + 1000

    def ev(gpu, seq, end, comm="tp/pp0", timed_out=False, duration=0.2):
        return CollectiveEvent("rg", f"rg:{gpu}", "all_reduce", 8, duration, 3, end, timed_out,
                               seq=seq, communicator=comm)

    pipeline.ingest([ev("pp0-tp1", 60, began + 40), ev("pp0-tp2", 61, began - 200),
                     ev("pp1-tp0", 7, began + 750, comm="tp/pp1")])
    sub = pipeline.subscribe("rg")
    pipeline.ingest([ev("pp0-tp0", 61, began + 1500, timed_out=True, duration=1500.0)])
    alert = sub.get(1.0)
    assert alert.kind is AlertKind.COLLECTIVE_TIMEOUT
    assert alert.message.endswith("not heard from since it began: rg:pp0-tp1"), alert.message


def test_a_peer_on_the_communicator_that_telemetry_never_heard_from_is_silent():
    # tp1 stopped before its shipper sent anything: no series of it at all. The timed-out op's
    # communicator and size say who its peers are, so tp1 is named all the same
    clock = Clock()
    pipeline = make_pipeline(clock)
    sub = pipeline.subscribe("rg")
    pipeline.ingest([CollectiveEvent("rg", "rg:pp0-tp0", "all_reduce", 8, 1500.0, 2, ORIGIN + 2500, True,
                                     seq=61, communicator="tp/pp0")])
    alert = sub.get(1.0)
    assert alert.kind is AlertKind.COLLECTIVE_TIMEOUT
    assert alert.message.endswith("not heard from since it began: rg:pp0-tp1"), alert.message
    assert alert.group_gpu_ids == ("rg:pp0-tp0", "rg:pp0-tp1")  # both marked unhealthy, the silent one too


def test_a_timeout_names_the_node_of_the_ranks_it_waited_on():
    # each rank's shipper says which node it runs on; a hung host's ranks go silent together
    clock = Clock()
    pipeline = make_pipeline(clock)
    began = ORIGIN + 1000
    for pp, tp in RANKS:
        pipeline.ingest([CollectiveEvent("rg", f"rg:pp{pp}-tp{tp}", "all_reduce", 8, 0.2, 2, began - 5, False)],
                        node_id=f"host-node{pp}")
    # node 1's ranks hang; node 0's other rank waits in the same broadcast (silent too), but the
    # rank that timed out is on node 0: only node 1 went quiet as a whole
    sub = pipeline.subscribe("rg")
    pipeline.ingest([CollectiveEvent("rg", "rg:pp0-tp0", "broadcast", 8, 2000.0, 4, began + 2000, True)],
                    node_id="host-node0")
    alert = sub.get(1.0)
    assert alert.kind is AlertKind.COLLECTIVE_TIMEOUT
    assert "not heard from since it began: rg:pp0-tp1, rg:pp1-tp0, rg:pp1-tp1" in alert.message
    assert alert.message.endswith("[on node host-node1]"), alert.message


def test_a_closed_connection_fails_the_group_at_once_naming_the_lost_node():
    # node 1's ranks were killed: the driver's next send fails at once on the closed connection
    # (``peer_lost``: no retry, so no flap first) and the alert names the node that went quiet
    clock = Clock()
    pipeline = make_pipeline(clock)
    began = ORIGIN + 1000
    for pp, tp in RANKS:
        pipeline.ingest([CollectiveEvent("rg", f"rg:pp{pp}-tp{tp}", "send", 8, 0.2, 2, began - 5, False)],
                        node_id=f"host-node{pp}")
    sub = pipeline.subscribe("rg")
    pipeline.ingest([CollectiveEvent("rg", "rg:pp0-tp0", "send", 8, 0.4, 2, began + 1, True, peer_lost=True)],
                    node_id="host-node0")
    alert = sub.get(1.0)
    assert (alert.kind, alert.new_status) == (AlertKind.STAGE_LINK_FAILURE, GroupStatus.UNHEALTHY)
    assert alert.message.startswith("send at a pipeline stage boundary failed on rg:pp0-tp0 after 0.00 s: its "
                                    "peer is gone (a closed connection"), alert.message
    assert alert.message.endswith("[on node host-node1]"), alert.message
    assert pipeline.rules.has_failed("rg") and sub.get(0.2) is None


def _drain(sub):
    while (alert := sub.get(0.1)) is not None:
        yield alert


@pytest.fixture
def registry(tmp_path):
    reg = ShardRegistry(f"sqlite:///{tmp_path / 'registry.db'}", migrate_schema=True)
    yield reg
    reg.close()


def register_group(registry: ShardRegistry, name: str) -> uuid.UUID:
    gid = registry_group_id(name)
    registry.create_replica_group("tiny", 2, 2, "float32", 1 << 20, name=name, replica_group_id=gid)
    registry.set_status(gid, "healthy", by="operator")
    return gid


def wait_for(predicate, timeout_s: float = 5.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    return predicate()


def test_registry_ids_are_stable_uuids_of_group_names(registry):
    assert registry_group_id("rg-abc") == registry_group_id("rg-abc") != registry_group_id("rg-abd")
    gid = uuid.uuid4()
    assert registry_group_id(str(gid)) == gid


def test_timeout_marks_every_rank_unhealthy_in_redis_and_drains_the_registry(redis_url, registry):
    group = f"rg-{uuid.uuid4().hex[:8]}"
    health = make_health_store(redis_url)
    health.heartbeat(group, {"pp0_tp0": "healthy", "pp0_tp1": "healthy"})  # the worker's heartbeat so far
    gid = register_group(registry, group)
    clock = Clock()
    pipeline = make_pipeline(clock, effects=GroupStatusEffects(health=health, registry=registry))
    try:
        pipeline.ingest([CollectiveEvent(group, f"{group}:pp{pp}-tp{tp}", "all_reduce", 8, 0.2, 2, ORIGIN, False)
                         for pp, tp in RANKS])
        pipeline.ingest([CollectiveEvent(group, f"{group}:pp0-tp1", "all_reduce", 8, 2000.0, 2, ORIGIN + 2100, True)])
        expected = {f"pp{pp}_tp{tp}": "unhealthy" for pp, tp in RANKS}
        assert wait_for(lambda: health.group_health(group) == expected), health.group_health(group)
        assert wait_for(lambda: registry.get_group(gid).status == "draining")
        assert "timed out" in registry.get_group(gid).status_reason
    finally:
        pipeline.close()
        health.remove_group(group)


def test_slow_rank_degrades_its_rank_and_the_group_then_recovers(redis_url, registry):
    group = f"rg-{uuid.uuid4().hex[:8]}"
    health = make_health_store(redis_url)
    health.heartbeat(group, {f"pp{pp}_tp{tp}": "healthy" for pp, tp in RANKS})
    gid = register_group(registry, group)
    clock, rng = Clock(), random.Random(4)
    pipeline = make_pipeline(clock, effects=GroupStatusEffects(health=health, registry=registry))
    try:
        run_windows(pipeline, clock, group, {}, 0, 3, rng)
        run_windows(pipeline, clock, group, {(1, 1): 30.0}, 3, 6, rng)  # pp1-tp0 is the straggler
        assert wait_for(lambda: registry.get_group(gid).status == "degraded")
        assert wait_for(lambda: health.group_health(group).get("pp1_tp0") == "degraded")
        assert health.group_health(group)["pp1_tp1"] == "healthy"
        run_windows(pipeline, clock, group, {}, 6, 9, rng)
        assert wait_for(lambda: registry.get_group(gid).status == "healthy")
        assert wait_for(lambda: health.group_health(group).get("pp1_tp0") == "healthy")
    finally:
        pipeline.close()
        health.remove_group(group)


def test_alerts_for_unregistered_groups_are_skipped(registry):
    pipeline = make_pipeline(Clock(), effects=GroupStatusEffects(registry=registry))
    try:
        pipeline.ingest([CollectiveEvent("nowhere", "nowhere:pp0-tp0", "send", 8, 2000.0, 2, ORIGIN, True)] * 2)
        assert [a.kind for a in pipeline.alerts()] == [AlertKind.STAGE_LINK_FLAP, AlertKind.STAGE_LINK_FAILURE]
    finally:
        pipeline.close()  # the effect worker logged and moved on


def link_event(group: str, gpu: str, at_ms: int, *, timed_out: bool, duration_ms: float = 1000.0,
               op: str = "send") -> CollectiveEvent:
    return CollectiveEvent(group, f"{group}:{gpu}", op, 4096, duration_ms, 2, at_ms, timed_out)


def test_a_retried_stage_link_timeout_degrades_the_group_and_recovers_when_the_link_stays_quiet():
    clock = Clock()
    pipeline = make_pipeline(clock, sustain_windows=3)
    sub = pipeline.subscribe("rg")
    # the coordinator's first wait ran out, its retry completed
    pipeline.ingest([link_event("rg", "pp0-tp0", ORIGIN + 1000, timed_out=True),
                     link_event("rg", "pp0-tp0", ORIGIN + 1500, timed_out=False, duration_ms=500.0)])
    flap = sub.get(1.0)
    assert flap.kind is AlertKind.STAGE_LINK_FLAP and flap.new_status is GroupStatus.DEGRADED
    assert flap.gpu_id == "rg:pp0-tp0" and flap.op_type == "send"
    assert "send at a pipeline stage boundary timed out on rg:pp0-tp0 after 1.00 s; the coordinator retries " \
           "it once" in flap.message and "replica group rg degraded" in flap.message
    assert not pipeline.rules.has_failed("rg")
    # another recovered flap of the same rank 2 s later, in two batches: no second alert (and no
    # failure: the retry's event ended the first streak), but the quiet period restarts
    clock.now = ORIGIN + 3000
    pipeline.ingest([link_event("rg", "pp0-tp0", ORIGIN + 3000, timed_out=True)])
    pipeline.ingest([link_event("rg", "pp0-tp0", ORIGIN + 3200, timed_out=False, duration_ms=200.0)])
    assert pipeline.tick() == [] and sub.get(0.2) is None
    clock.now = ORIGIN + 3000 + 2900  # 2.9 s of the 3 windows' quiet
    assert pipeline.tick() == []
    clock.now = ORIGIN + 3000 + 3000
    (recovered,) = pipeline.tick()
    assert recovered.kind is AlertKind.STAGE_LINK_FLAP and recovered.new_status is GroupStatus.HEALTHY
    assert recovered.gpu_id == "rg:pp0-tp0" and "recovered: no stage-link timeout for 3 s" in recovered.message
    assert sub.get(1.0) == recovered
    # a later flap alerts again
    pipeline.ingest([link_event("rg", "pp0-tp0", clock.now + 100, timed_out=True)])
    assert sub.get(1.0).new_status is GroupStatus.DEGRADED


def test_a_stage_link_timeout_after_its_retry_drains_the_group():
    clock = Clock()
    pipeline = make_pipeline(clock, sustain_windows=1)
    sub = pipeline.subscribe("rg")
    # pp1-tp0's recv times out; pp1-tp1's ops go on (they do not end pp1-tp0's streak) ...
    pipeline.ingest([link_event("rg", "pp1-tp0", ORIGIN + 1000, timed_out=True, op="recv"),
                     link_event("rg", "pp1-tp1", ORIGIN + 1000, timed_out=False, op="recv")])
    flap = sub.get(1.0)
    assert (flap.kind, flap.new_status, flap.gpu_id) == (AlertKind.STAGE_LINK_FLAP, GroupStatus.DEGRADED,
                                                         "rg:pp1-tp0")
    assert sub.get(0.2) is None and not pipeline.rules.has_failed("rg")
    # ... and its retry, the rank's next event, times out too (in the next batch)
    pipeline.ingest([link_event("rg", "pp1-tp0", ORIGIN + 2000, timed_out=True, op="recv")])
    failure = sub.get(1.0)
    assert (failure.kind, failure.new_status) == (AlertKind.STAGE_LINK_FAILURE, GroupStatus.DRAINING)
    assert failure.message.startswith("recv at a pipeline stage boundary timed out again on rg:pp1-tp0 after the "
                                      "coordinator's retry (1.00 s): draining replica group rg")
    assert pipeline.rules.has_failed("rg")
    clock.now = ORIGIN + 10_000
    assert pipeline.tick() == []  # a failed group does not recover
    pipeline.ingest([link_event("rg", "pp1-tp1", ORIGIN + 10_000, timed_out=True)] * 2)
    assert sub.get(0.2) is None


def test_two_stage_link_timeouts_with_other_ops_between_are_two_flaps_not_a_failure():
    pipeline = make_pipeline(Clock())
    sub = pipeline.subscribe("rg")
    broadcast = CollectiveEvent("rg", "rg:pp0-tp0", "broadcast", 8, 0.1, 2, ORIGIN + 1500, False)
    pipeline.ingest([link_event("rg", "pp0-tp0", ORIGIN + 1000, timed_out=True), broadcast,
                     link_event("rg", "pp0-tp0", ORIGIN + 2000, timed_out=True)])
    assert [(a.kind, a.new_status) for a in _drain(sub)] == [(AlertKind.STAGE_LINK_FLAP, GroupStatus.DEGRADED)]
    assert not pipeline.rules.has_failed("rg")


def test_a_link_flap_degrades_its_rank_and_the_group_then_recovers(redis_url, registry):
    group = f"rg-{uuid.uuid4().hex[:8]}"
    health = make_health_store(redis_url)
    health.heartbeat(group, {f"pp{pp}_tp{tp}": "healthy" for pp, tp in RANKS})
    gid = register_group(registry, group)
    clock = Clock()
    pipeline = make_pipeline(clock, effects=GroupStatusEffects(health=health, registry=registry), sustain_windows=2)
    try:
        pipeline.ingest([link_event(group, "pp1-tp1", ORIGIN + 500, timed_out=True, op="recv")])
        assert wait_for(lambda: registry.get_group(gid).status == "degraded")
        assert wait_for(lambda: health.group_health(group).get("pp1_tp1") == "degraded")
        assert health.group_health(group)["pp0_tp0"] == "healthy"
        clock.now = ORIGIN + 500 + 2000
        assert [a.new_status for a in pipeline.tick()] == [GroupStatus.HEALTHY]
        assert wait_for(lambda: registry.get_group(gid).status == "healthy")
        assert wait_for(lambda: health.group_health(group).get("pp1_tp1") == "healthy")
    finally:
        pipeline.close()
        health.remove_group(group)
