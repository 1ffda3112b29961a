"""Replica-group lifecycle: provisioning -> healthy -> degraded -> draining -> dead.

A group that is dead stays dead: a new group (new id) replaces it, so that a group whose
collectives once hung is never reused.
"""

from __future__ import annotations

PROVISIONING = "provisioning"
HEALTHY = "healthy"
DEGRADED = "degraded"
DRAINING = "draining"
DEAD = "dead"

GROUP_STATUSES: tuple[str, ...] = (PROVISIONING, HEALTHY, DEGRADED, DRAINING, DEAD)
# the statuses of a group that takes requests (a degraded group still does, with an alert out)
IN_ROTATION: tuple[str, ...] = (HEALTHY, DEGRADED)

ALLOWED_TRANSITIONS: dict[str, tuple[str, ...]] = {
    PROVISIONING: (HEALTHY, DEAD),
    HEALTHY: (DEGRADED, DRAINING, DEAD),
    DEGRADED: (HEALTHY, DRAINING, DEAD),
    DRAINING: (DEAD,),
    DEAD: (),
}

# Per-shard status (the gpu_shards.status extension): what the rank last reported.
SHARD_STATUSES: tuple[str, ...] = ("starting", "healthy", "degraded", "unhealthy", "draining")


def can_transition(from_status: str, to_status: str) -> bool:
    return to_status in ALLOWED_TRANSITIONS.get(from_status, ())
