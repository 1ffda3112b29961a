"""One status model: the enum is the wire's, the lifecycle is the union of what each writer may
do, and the registry refuses a writer's move that is not its own."""

from __future__ import annotations

import pytest

from services.common.group_status import ALLOWED_TRANSITIONS, GROUP_STATUSES, MOVERS, GroupStatus, can_transition
from services.common.proto import common_pb2
from services.common.registry import IllegalTransition, ShardRegistry
from services.common.registry.errors import InvalidValue


def test_the_enum_is_the_protos_by_name() -> None:
    wire = {name.removeprefix("REPLICA_GROUP_STATUS_") for name in common_pb2.ReplicaGroupStatus.keys()}
    assert wire - {"UNSPECIFIED"} == {s.name for s in GroupStatus}
    assert GROUP_STATUSES == ("provisioning", "healthy", "degraded", "draining", "dead")  # unhealthy: never recorded


def test_the_lifecycle_is_every_writers_moves_and_dead_is_final() -> None:
    assert ALLOWED_TRANSITIONS == {"provisioning": ("healthy", "dead"), "healthy": ("degraded", "draining", "dead"),
                                   "degraded": ("healthy", "draining", "dead"), "draining": ("dead",), "dead": ()}
    assert not any(moves.get("dead") for moves in MOVERS.values())
    assert can_transition("healthy", "degraded", by="telemetry") and not can_transition("healthy", "dead", "telemetry")
    assert can_transition("provisioning", "healthy", by="fleet") and not can_transition("draining", "healthy")


def test_the_registry_refuses_a_move_its_writer_may_not_make(tmp_path) -> None:
    with ShardRegistry(f"sqlite:///{tmp_path / 'r.db'}", migrate_schema=True) as registry:
        gid = registry.create_replica_group("tiny", 1, 1, "bf16", 0).replica_group_id
        with pytest.raises(IllegalTransition):
            registry.set_status(gid, "healthy", by="telemetry")  # only a driver or the controller rotates a group in
        registry.set_status(gid, "healthy", by="driver")
        with pytest.raises(IllegalTransition):
            registry.set_status(gid, "dead", by="telemetry")  # telemetry drains; the driver or controller ends
        assert registry.set_status(gid, "degraded", by="telemetry").status == "degraded"
        with pytest.raises(InvalidValue):
            registry.set_status(gid, "healthy", by="someone")
