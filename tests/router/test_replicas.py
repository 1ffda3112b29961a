"""A group's status from its sources: Stats, the worker's health, the health store, the registry."""

from __future__ import annotations

import pytest

from services.common.group_status import GroupStatus
from services.common.health import MemoryHealthStore, rank_fields
from services.router.replicas import ReplicaGroupView, WorkerStats, worst_status

STATS = WorkerStats("rg-a", "tiny", 2, 1, "float32", kv_bytes_used=0, kv_bytes_capacity=1 << 20,
                    kv_bytes_per_token=2048, max_model_len=512)


def reported(**fields) -> ReplicaGroupView:
    v = ReplicaGroupView(address="127.0.0.1:1")
    v.apply_stats(STATS, now=100.0, wall_ms=1)
    for name, value in fields.items():
        setattr(v, name, value)
    return v


@pytest.mark.parametrize(("fields", "now", "status"), [
    ({}, 100.5, GroupStatus.HEALTHY),
    ({}, 103.5, GroupStatus.UNHEALTHY),  # no report for 3.5 s
    ({"stats_error": "UNAVAILABLE"}, 100.5, GroupStatus.UNHEALTHY),
    ({"worker_serving": False}, 100.5, GroupStatus.UNHEALTHY),
    ({"draining": True}, 100.5, GroupStatus.DRAINING),
    ({"registry_status": "draining"}, 100.5, GroupStatus.DRAINING),
    ({"registry_status": "dead"}, 100.5, GroupStatus.DEAD),
    ({"registry_status": "degraded"}, 100.5, GroupStatus.DEGRADED),
    ({"store_seen": True, "store_status": "healthy"}, 100.5, GroupStatus.HEALTHY),
    ({"store_seen": True, "store_status": "degraded"}, 100.5, GroupStatus.DEGRADED),
    ({"store_seen": True, "store_status": "unhealthy"}, 100.5, GroupStatus.UNHEALTHY),
    ({"store_seen": True, "store_status": "draining"}, 100.5, GroupStatus.DRAINING),
    ({"store_seen": True, "store_status": None}, 100.5, GroupStatus.UNHEALTHY),  # expired
    ({"store_seen": False, "store_status": None}, 100.5, GroupStatus.HEALTHY),  # never reports to the store
    ({"failed": "collective timed out"}, 100.5, GroupStatus.UNHEALTHY),
])
def test_status_from_its_sources(fields, now, status):
    v = reported(**fields)
    assert v.refresh_status(now) is status
    assert v.status.routable == (status in (GroupStatus.HEALTHY, GroupStatus.DEGRADED))


def test_a_group_that_never_reported_is_provisioning():
    v = ReplicaGroupView(address="127.0.0.1:1", stats_error="still loading")
    assert v.refresh_status(1.0) is GroupStatus.PROVISIONING and v.status_reason == "still loading"


def test_a_new_group_at_the_same_address_starts_clean():
    v = reported(failed="collective timed out", store_seen=True, store_status=None)
    v.apply_stats(WorkerStats(**{**STATS.__dict__, "replica_group_id": "rg-b"}), now=101.0, wall_ms=2)
    assert (v.replica_group_id, v.failed, v.store_seen) == ("rg-b", "", False)
    assert v.refresh_status(101.0) is GroupStatus.HEALTHY


def test_worst_status_reads_the_store_as_the_router_does():
    store = MemoryHealthStore()
    fields = rank_fields(2, 2)
    store.heartbeat("rg-a", dict.fromkeys(fields, "healthy"))
    assert worst_status(store.group_health("rg-a")) == "healthy"
    store.heartbeat("rg-a", {fields[3]: "degraded"})
    assert worst_status(store.group_health("rg-a")) == "degraded"
    store.mark_group("rg-a", "draining")
    assert worst_status(store.group_health("rg-a")) == "draining"
    store.heartbeat("rg-a", {fields[0]: "unhealthy"})
    assert worst_status(store.group_health("rg-a")) == "unhealthy"
    assert worst_status({}) is None
