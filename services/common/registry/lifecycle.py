"""Replica-group lifecycle (services/common/group_status.py: the statuses, their moves and who
makes each) and each shard's status."""

from __future__ import annotations

from services.common.group_status import (
    ALLOWED_TRANSITIONS,
    DEAD,
    DEGRADED,
    DRAINING,
    GROUP_STATUSES,
    HEALTHY,
    IN_ROTATION,
    MOVERS,
    PROVISIONING,
    can_transition,
)

# Per-shard status (the gpu_shards.status extension): what the rank last reported.
SHARD_STATUSES: tuple[str, ...] = ("starting", "healthy", "degraded", "unhealthy", "draining")

__all__ = ["ALLOWED_TRANSITIONS", "DEAD", "DEGRADED", "DRAINING", "GROUP_STATUSES", "HEALTHY", "IN_ROTATION",
           "MOVERS", "PROVISIONING", "SHARD_STATUSES", "can_transition"]
