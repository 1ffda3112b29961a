"""Shard registry: replica groups, their GPU shards, checkpoint manifests, quality-gate verdicts
and fleets (SQLAlchemy 2).

PostgreSQL via psycopg 3 (``postgresql+psycopg://``) in production and tests, a SQLite file as
the embedded default; the schema comes from the Alembic migration (``migrate.upgrade(url)``).

Each name below is imported from its module when it is first used: the group statuses and
:func:`registry_group_id` come without SQLAlchemy, so a process that only names groups (a worker
started without ``--registry-url``) does not pay about 0.6 s of CPU to load the ORM.
"""

from __future__ import annotations

import importlib
from typing import Any

# each name the package exports, and the module it comes from
_MODULE_OF = {
    **dict.fromkeys(("PROJECT_DTYPES", "REGISTRY_DTYPES", "to_project_dtype", "to_registry_dtype"), "dtypes"),
    **dict.fromkeys(("default_registry_url", "make_engine", "registry_url", "state_dir"), "engine"),
    **dict.fromkeys(("Conflict", "DuplicateManifest", "DuplicateShard", "GroupNotFound", "IllegalTransition",
                     "InvalidValue", "ManifestNotFound", "NotFound", "RegistryError", "ShardNotFound"), "errors"),
    "FleetNotFound": "fleet_store",
    "registry_group_id": "ids",
    **dict.fromkeys(("Fenced", "Lease"), "leases"),
    **dict.fromkeys(("ALLOWED_TRANSITIONS", "GROUP_STATUSES", "IN_ROTATION", "SHARD_STATUSES"), "lifecycle"),
    **dict.fromkeys(("downgrade", "upgrade"), "migrate"),
    **dict.fromkeys(("CheckpointManifest", "FleetRevision", "FleetRollout", "GpuShard", "QualityGateResult",
                     "ReplicaGroup"), "records"),
    **dict.fromkeys(("GroupIsDead", "ShardRegistry"), "repository"),
}

__all__ = sorted(_MODULE_OF)


def __getattr__(name: str) -> Any:
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value  # the next use is a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_MODULE_OF})

