"""The registry's fleet records, on PostgreSQL and SQLite: revisions, rollouts, groups' origins."""

from __future__ import annotations

import json

import pytest

from services.common.registry import Conflict, FleetNotFound, ShardRegistry, registry_group_id


@pytest.fixture
def registry(registry_of_each_kind: ShardRegistry) -> ShardRegistry:
    return registry_of_each_kind


def test_apply_numbers_revisions_and_an_unchanged_spec_makes_none(registry: ShardRegistry) -> None:
    with pytest.raises(FleetNotFound):
        registry.fleet_revision("smol")
    first, created = registry.apply_fleet("smol", json.dumps({"replicas": 2}))
    assert (first.revision, created) == (1, True)
    again, created = registry.apply_fleet("smol", json.dumps({"replicas": 2}))
    assert (again.revision, created) == (1, False)
    second, created = registry.apply_fleet("smol", json.dumps({"replicas": 3}))
    assert (second.revision, created) == (2, True)
    assert registry.fleet_revision("smol").revision == 2
    assert json.loads(registry.fleet_revision("smol", 1).spec) == {"replicas": 2}
    registry.apply_fleet("other", "{}")
    assert registry.list_fleets() == ["other", "smol"]


def test_rollouts_record_status_and_events(registry: ShardRegistry) -> None:
    assert registry.latest_rollout("smol") is None
    rollout = registry.create_rollout("smol", 1, 2)
    assert rollout.status == "running" and not rollout.done
    registry.update_rollout(rollout.rollout_id, event={"event": "provisioning", "group": "smol-a"})
    done = registry.update_rollout(rollout.rollout_id, status="failed", reason="gate", event={"event": "gate-failed"})
    assert done is not None and done.done and done.reason == "gate"
    assert [e["event"] for e in json.loads(done.events)] == ["provisioning", "gate-failed"]
    assert registry.update_rollout(rollout.rollout_id, status="aborting", only_if="running") is None
    later = registry.create_rollout("smol", 2, 3)
    assert [r.rollout_id for r in registry.list_rollouts("smol")] == [later.rollout_id, rollout.rollout_id]
    assert registry.latest_rollout("smol").rollout_id == later.rollout_id


def test_a_controller_declared_group_is_adopted_by_its_driver_once(registry: ShardRegistry) -> None:
    gid = registry_group_id("smol-abc123")
    assert registry.adopt_provisioning_group(gid, model_name="m", tp_degree=1, pp_degree=2, dtype="bf16",
                                             kv_cache_cap_bytes=10, endpoint="127.0.0.1:1") is None
    registry.create_replica_group("smol", 1, 2, "bfloat16", 0, name="smol-abc123", replica_group_id=gid,
                                  fleet_name="smol", fleet_revision=3, manifest_uri="/models/smol")
    with pytest.raises(Conflict, match="its driver loaded TP2 x PP1"):
        registry.adopt_provisioning_group(gid, model_name="m", tp_degree=2, pp_degree=1, dtype="bf16",
                                          kv_cache_cap_bytes=10, endpoint="127.0.0.1:1")
    adopted = registry.adopt_provisioning_group(gid, model_name="smollm2", tp_degree=1, pp_degree=2, dtype="bf16",
                                                kv_cache_cap_bytes=10, endpoint="127.0.0.1:1")
    assert adopted is not None
    assert (adopted.model_name, adopted.kv_cache_cap_bytes, adopted.endpoint) == ("smollm2", 10, "127.0.0.1:1")
    assert (adopted.fleet_name, adopted.fleet_revision, adopted.manifest_uri) == ("smol", 3, "/models/smol")
    assert [g.name for g in registry.fleet_groups("smol")] == ["smol-abc123"]
    registry.set_status(gid, "healthy", by="operator")
    with pytest.raises(Conflict, match="a group is started once"):
        registry.adopt_provisioning_group(gid, model_name="m", tp_degree=1, pp_degree=2, dtype="bf16",
                                          kv_cache_cap_bytes=10, endpoint="127.0.0.1:1")
    registry.set_status(gid, "dead", reason="test", by="operator")
    assert registry.fleet_groups("smol") == []
    assert [g.status for g in registry.fleet_groups("smol", include_dead=True)] == ["dead"]
