"""Health store: one suite against a real Redis server and the in-process store."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator

import pytest
import redis

from services.common.health import (
    HealthStore,
    InvalidHealthValue,
    MemoryHealthStore,
    RedisHealthStore,
    make_health_store,
    parse_rank_field,
    rank_field,
    rank_fields,
)

pytestmark = pytest.mark.waits  # on entries expiring (tests/lanes.py)

ALL_HEALTHY_TP2_PP2 = {"pp0_tp0": "healthy", "pp0_tp1": "healthy", "pp1_tp0": "healthy", "pp1_tp1": "healthy"}


@pytest.fixture(params=["redis", "memory"])
def store(request: pytest.FixtureRequest) -> Iterator[HealthStore]:
    if request.param == "memory":
        yield make_health_store("memory://")
        return
    url = request.getfixturevalue("redis_url")
    # a unique prefix per test keeps tests independent on one shared server
    s = make_health_store(url, key_prefix=f"test-{uuid.uuid4().hex[:8]}:")
    assert isinstance(s, RedisHealthStore)
    yield s
    s.close()


def test_heartbeat_then_read(store: HealthStore) -> None:
    store.heartbeat("g1", {"pp1_tp1": "healthy", "pp0_tp0": "healthy", "pp1_tp0": "degraded",
                           "pp0_tp1": "healthy"})
    assert list(store.group_health("g1").items()) == [  # global-rank order
        ("pp0_tp0", "healthy"), ("pp0_tp1", "healthy"), ("pp1_tp0", "degraded"), ("pp1_tp1", "healthy")]
    assert store.is_healthy("g1") is False
    store.heartbeat("g1", {"pp1_tp0": "healthy"})  # merges: one rank's report
    assert store.group_health("g1") == ALL_HEALTHY_TP2_PP2
    assert store.is_healthy("g1") is True
    assert store.is_healthy("g1", expected=rank_fields(2, 2)) is True
    assert store.is_healthy("g1", expected=rank_fields(4, 2)) is False  # ranks missing
    assert store.group_health("never") == {}
    assert store.is_healthy("never") is False
    assert store.list_groups() == ["g1"]


def test_seed_pp1_field_names_are_accepted(store: HealthStore) -> None:
    store.heartbeat("replica-03", {"tp_rank_0": "healthy", "tp_rank_1": "healthy",
                                   "tp_rank_2": "healthy", "tp_rank_3": "degraded"})
    assert store.group_health("replica-03") == {
        "pp0_tp0": "healthy", "pp0_tp1": "healthy", "pp0_tp2": "healthy", "pp0_tp3": "degraded"}
    assert store.is_healthy("replica-03", expected=["tp_rank_0"]) is False


def test_uuid_group_ids(store: HealthStore) -> None:
    gid = uuid.uuid4()
    store.heartbeat(gid, {"pp0_tp0": "healthy"})
    assert store.group_health(str(gid)) == {"pp0_tp0": "healthy"}
    assert store.list_groups() == [str(gid)]


def test_group_expires_without_heartbeat(store: HealthStore) -> None:
    store.heartbeat("g1", {"pp0_tp0": "healthy", "pp0_tp1": "healthy"}, ttl_s=1)
    store.heartbeat("g2", {"pp0_tp0": "healthy"}, ttl_s=30)
    store.set_kv_utilization("g1", 0.1)
    store.set_kv_utilization("g2", 0.5)
    assert store.list_groups() == ["g1", "g2"]
    time.sleep(1.3)
    assert store.group_health("g1") == {}
    assert store.is_healthy("g1") is False
    assert store.list_groups() == ["g2"]
    assert store.kv_utilizations() == {"g2": 0.5}  # an expired group's util is not live
    assert store.mark_group("g1", "unhealthy") == 0  # nothing left to mark, nothing recreated
    assert store.group_health("g1") == {}
    store.heartbeat("g1", {"pp0_tp0": "healthy"}, ttl_s=30)  # comes back with its next beat
    assert store.group_health("g1") == {"pp0_tp0": "healthy"}
    assert store.kv_utilizations() == {"g1": 0.1, "g2": 0.5}


def test_heartbeat_refreshes_ttl(store: HealthStore) -> None:
    store.heartbeat("g1", {"pp0_tp0": "healthy"}, ttl_s=1.5)
    time.sleep(0.9)
    store.heartbeat("g1", {"pp0_tp0": "healthy"}, ttl_s=1.5)
    time.sleep(0.9)  # 1.8 s after the first beat, 0.9 s after the second
    assert store.group_health("g1") == {"pp0_tp0": "healthy"}


def test_a_rank_that_stops_beating_disappears_while_peers_beat_on(store: HealthStore) -> None:
    store.heartbeat("g1", {"pp0_tp0": "healthy", "pp0_tp1": "healthy"}, ttl_s=1.5)
    time.sleep(0.9)
    store.heartbeat("g1", {"pp0_tp0": "healthy"}, ttl_s=1.5)  # tp1 has gone quiet
    time.sleep(0.9)
    assert store.group_health("g1") == {"pp0_tp0": "healthy"}
    assert store.is_healthy("g1") is True
    assert store.is_healthy("g1", expected=rank_fields(2)) is False
    assert store.mark_group("g1", "draining") == 1  # only live ranks get marked
    assert store.group_health("g1") == {"pp0_tp0": "draining"}


def test_mark_group_keeps_ttl(store: HealthStore) -> None:
    store.heartbeat("g1", ALL_HEALTHY_TP2_PP2, ttl_s=1)
    assert store.mark_group("g1", "unhealthy") == 4
    assert store.group_health("g1") == dict.fromkeys(ALL_HEALTHY_TP2_PP2, "unhealthy")
    assert store.is_healthy("g1") is False
    time.sleep(1.3)
    assert store.group_health("g1") == {}  # marking did not extend or remove the TTL
    assert store.list_groups() == []


def test_kv_utilization_order_and_updates(store: HealthStore) -> None:
    for gid, util in (("g-a", 0.82), ("g-b", 0.10), ("g-c", 0.45), ("g-d", 0.45)):
        store.heartbeat(gid, {"pp0_tp0": "healthy"})
        store.set_kv_utilization(gid, util)
    assert list(store.kv_utilizations().items()) == [
        ("g-b", 0.10), ("g-c", 0.45), ("g-d", 0.45), ("g-a", 0.82)]
    store.set_kv_utilization("g-b", 0.99)
    store.set_kv_utilization("g-a", 0.0)
    assert list(store.kv_utilizations()) == ["g-a", "g-c", "g-d", "g-b"]
    store.set_kv_utilization("no-heartbeat-yet", 0.2)
    assert "no-heartbeat-yet" not in store.kv_utilizations()


def test_remove_group(store: HealthStore) -> None:
    store.heartbeat("g1", {"pp0_tp0": "healthy"})
    store.heartbeat("g2", {"pp0_tp0": "healthy"})
    store.set_kv_utilization("g1", 0.3)
    store.set_kv_utilization("g2", 0.4)
    store.remove_group("g1")
    assert store.group_health("g1") == {}
    assert store.list_groups() == ["g2"]
    assert store.kv_utilizations() == {"g2": 0.4}
    store.remove_group("g1")  # idempotent
    store.heartbeat("g1", {"pp0_tp0": "healthy"})
    assert store.kv_utilizations() == {"g2": 0.4}  # its old util was removed, not hidden


def test_bad_values_are_rejected(store: HealthStore) -> None:
    with pytest.raises(InvalidHealthValue, match=r"^unknown rank status 'ok': expected one of "
                                                 r"healthy, degraded, unhealthy, draining$"):
        store.heartbeat("g1", {"pp0_tp0": "ok"})
    with pytest.raises(InvalidHealthValue, match=r"^bad rank field 'rank0': expected "):
        store.heartbeat("g1", {"rank0": "healthy"})
    with pytest.raises(InvalidHealthValue, match=r"^rank pp0_tp0 given twice in one heartbeat"):
        store.heartbeat("g1", {"pp0_tp0": "healthy", "tp_rank_0": "healthy"})
    with pytest.raises(InvalidHealthValue, match=r"at least one rank"):
        store.heartbeat("g1", {})
    with pytest.raises(InvalidHealthValue, match=r"^ttl_s must be a finite number >= 0.001, got 0$"):
        store.heartbeat("g1", {"pp0_tp0": "healthy"}, ttl_s=0)
    with pytest.raises(InvalidHealthValue, match=r"^KV utilization must be within \[0, 1\], got 1.5$"):
        store.set_kv_utilization("g1", 1.5)
    with pytest.raises(InvalidHealthValue):
        store.set_kv_utilization("g1", float("nan"))
    with pytest.raises(InvalidHealthValue, match=r"unknown rank status 'dead'"):
        store.mark_group("g1", "dead")
    assert store.list_groups() == []


def test_concurrent_heartbeats_from_many_threads(store: HealthStore) -> None:
    def beat(pp_stage: int) -> None:
        for _ in range(20):
            store.heartbeat("g1", {rank_field(r, pp_stage): "healthy" for r in range(4)})

    threads = [threading.Thread(target=beat, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert store.group_health("g1") == dict.fromkeys(rank_fields(4, 4), "healthy")
    assert store.is_healthy("g1", expected=rank_fields(4, 4)) is True


# ---- Redis specifics: the original raw layout --------------------------------------------------


def test_redis_keys_follow_the_seed_layout(redis_url: str) -> None:
    prefix = f"test-{uuid.uuid4().hex[:8]}:"
    store = RedisHealthStore(redis_url, key_prefix=prefix)
    raw = redis.Redis.from_url(redis_url, decode_responses=True)
    try:
        store.heartbeat("replica-03", {"pp0_tp0": "healthy", "pp0_tp1": "degraded"})
        store.set_kv_utilization("replica-03", 0.82)
        key = f"{prefix}shardhealth:replica-03"
        assert raw.hgetall(key) == {"pp0_tp0": "healthy", "pp0_tp1": "degraded"}
        assert 29_000 < raw.pttl(key) <= 30_000
        assert raw.zscore(f"{prefix}replica_kv_util", "replica-03") == 0.82
        store.mark_group("replica-03", "unhealthy")
        assert 29_000 < raw.pttl(key) <= 30_000  # HSET by mark_group kept the TTL
        # a hash written by hand, PP=1 names, is read too (it lives as long as its EXPIRE)
        raw.hset(f"{prefix}shardhealth:replica-04", mapping={"tp_rank_0": "healthy", "tp_rank_1": "healthy"})
        raw.expire(f"{prefix}shardhealth:replica-04", 30)
        assert store.group_health("replica-04") == {"pp0_tp0": "healthy", "pp0_tp1": "healthy"}
        assert store.is_healthy("replica-04") is True
        store.remove_group("replica-03")
        assert raw.exists(key) == 0
        assert raw.zscore(f"{prefix}replica_kv_util", "replica-03") is None
    finally:
        for k in raw.scan_iter(f"{prefix}*"):
            raw.delete(k)
        raw.close()
        store.close()


# ---- helpers and factory -----------------------------------------------------------------------


def test_rank_field_names() -> None:
    assert rank_field(3, 1) == "pp1_tp3"
    assert rank_fields(2, 2) == ["pp0_tp0", "pp0_tp1", "pp1_tp0", "pp1_tp1"]
    assert parse_rank_field("pp1_tp3") == (1, 3)
    assert parse_rank_field("tp_rank_3") == (0, 3)
    with pytest.raises(InvalidHealthValue):
        parse_rank_field("pp1-tp3")


def test_factory() -> None:
    assert isinstance(make_health_store(None), MemoryHealthStore)
    assert isinstance(make_health_store("memory://", default_ttl_s=5), MemoryHealthStore)
    with pytest.raises(InvalidHealthValue, match=r"^unsupported health store URL 'http://x': expected memory://"):
        make_health_store("http://x")


def test_memory_store_expiry_on_an_injected_clock() -> None:
    now = [1000.0]
    store = MemoryHealthStore(clock=lambda: now[0], default_ttl_s=30)
    store.heartbeat("g1", {"pp0_tp0": "healthy"})
    now[0] += 29.9
    assert store.is_healthy("g1") is True
    now[0] += 0.2
    assert store.group_health("g1") == {}
    assert store.list_groups() == []
