"""Shard registry: replica groups, their GPU shards, checkpoint manifests, quality-gate verdicts
and fleets (SQLAlchemy 2).

PostgreSQL via psycopg 3 (``postgresql+psycopg://``) in production and tests, a SQLite file as
the embedded default; the schema comes from the Alembic migration (``migrate.upgrade(url)``).
"""

from __future__ import annotations

from .dtypes import PROJECT_DTYPES, REGISTRY_DTYPES, to_project_dtype, to_registry_dtype
from .engine import default_registry_url, make_engine, registry_url, state_dir
from .errors import (
    Conflict,
    DuplicateManifest,
    DuplicateShard,
    GroupNotFound,
    IllegalTransition,
    InvalidValue,
    ManifestNotFound,
    NotFound,
    RegistryError,
    ShardNotFound,
)
from .fleet_store import FleetNotFound
from .leases import Fenced, Lease
from .lifecycle import ALLOWED_TRANSITIONS, GROUP_STATUSES, IN_ROTATION, SHARD_STATUSES
from .migrate import downgrade, upgrade
from .records import (
    CheckpointManifest,
    FleetRevision,
    FleetRollout,
    GpuShard,
    QualityGateResult,
    ReplicaGroup,
    registry_group_id,
)
from .repository import GroupIsDead, ShardRegistry

__all__ = [
    "ALLOWED_TRANSITIONS", "GROUP_STATUSES", "IN_ROTATION", "PROJECT_DTYPES", "REGISTRY_DTYPES", "SHARD_STATUSES",
    "CheckpointManifest", "Conflict", "DuplicateManifest", "DuplicateShard", "Fenced", "FleetNotFound", "FleetRevision",
    "FleetRollout", "GpuShard",
    "GroupIsDead", "GroupNotFound", "IllegalTransition", "InvalidValue", "Lease", "ManifestNotFound",
    "NotFound", "QualityGateResult", "RegistryError", "ReplicaGroup", "ShardNotFound", "ShardRegistry",
    "default_registry_url", "downgrade", "make_engine", "registry_url", "state_dir",
    "registry_group_id", "to_project_dtype", "to_registry_dtype", "upgrade",
]
