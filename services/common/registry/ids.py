"""How a replica group's name becomes its registry id: a module of its own, without SQLAlchemy,
so that a service that only names groups (a worker without a registry) does not load the ORM."""

from __future__ import annotations

import uuid


def registry_group_id(replica_group_id: str) -> uuid.UUID:
    """The registry's UUID of a replica group: the id itself when it is a UUID, else the stable
    UUID5 of the name (``rg-0-3fa2c1``), so every service that knows a group by its name finds
    the same row."""
    try:
        return uuid.UUID(replica_group_id)
    except ValueError:
        return uuid.uuid5(uuid.NAMESPACE_URL, f"shardline:{replica_group_id}")
