"""A replica group's status: one enum for the registry, the router's view, telemetry's alerts and
the wire (``ReplicaGroupStatus`` in common.proto, the same names: a test checks), and who may move
a group from which recorded status to which.

The registry records five statuses, a group's lifecycle: provisioning -> healthy <-> degraded ->
draining -> dead. A dead group stays dead: a new group (a new id) replaces it, so that a group
whose collectives once hung is never reused. ``unhealthy`` is never recorded: it is the router's
and the health store's word for a group whose rank timed out a collective or stopped
heartbeating, which telemetry then records as draining.

Who moves a group (``MOVERS``; the registry refuses any other move by that writer):

| writer | moves | when |
|---|---|---|
| driver (the group's rank 0) | provisioning -> healthy | loaded, when no fleet controller puts it in rotation |
| | healthy, degraded -> draining -> dead; any -> dead | stopping, or a rank failed |
| telemetry | healthy <-> degraded; healthy, degraded -> draining | a collective alert, or its recovery |
| fleet controller | provisioning -> healthy | its checks passed: in rotation |
| | provisioning, healthy, degraded -> dead; -> draining -> dead | a failed start, a heal, a retirement |
| operator (a person repairing the registry by hand; the tests) | any move of the lifecycle | |
"""

from __future__ import annotations

from enum import Enum


class GroupStatus(Enum):
    PROVISIONING = "provisioning"
    HEALTHY = "healthy"
    DEGRADED = "degraded"
    DRAINING = "draining"
    DEAD = "dead"
    UNHEALTHY = "unhealthy"  # the router's and the health store's view only (never recorded)

    @property
    def routable(self) -> bool:
        """A group in this status takes new requests (a degraded one still does, its alert out)."""
        return self in (GroupStatus.HEALTHY, GroupStatus.DEGRADED)

    @property
    def recorded(self) -> bool:
        """A status the registry records (every one but unhealthy)."""
        return self is not GroupStatus.UNHEALTHY


PROVISIONING, HEALTHY, DEGRADED, DRAINING, DEAD = (s.value for s in GroupStatus if s.recorded)
GROUP_STATUSES: tuple[str, ...] = tuple(s.value for s in GroupStatus if s.recorded)
IN_ROTATION: tuple[str, ...] = tuple(s.value for s in GroupStatus if s.routable)

_ENDING = {PROVISIONING: (DEAD,), HEALTHY: (DRAINING, DEAD), DEGRADED: (DRAINING, DEAD), DRAINING: (DEAD,)}
MOVERS: dict[str, dict[str, tuple[str, ...]]] = {
    "driver": {**_ENDING, PROVISIONING: (HEALTHY, DEAD)},
    "telemetry": {HEALTHY: (DEGRADED, DRAINING), DEGRADED: (HEALTHY, DRAINING)},
    "fleet": {**_ENDING, PROVISIONING: (HEALTHY, DEAD)},
    "operator": {PROVISIONING: (HEALTHY, DEAD), HEALTHY: (DEGRADED, DRAINING, DEAD),
                 DEGRADED: (HEALTHY, DRAINING, DEAD), DRAINING: (DEAD,)},
}
# every move some writer may make: the lifecycle
ALLOWED_TRANSITIONS: dict[str, tuple[str, ...]] = {
    status: tuple(t for t in GROUP_STATUSES if any(t in moves.get(status, ()) for moves in MOVERS.values()))
    for status in GROUP_STATUSES
}


def can_transition(from_status: str, to_status: str, by: str = "operator") -> bool:
    return to_status in MOVERS.get(by, {}).get(from_status, ())
