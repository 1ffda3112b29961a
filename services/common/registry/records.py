"""Plain, immutable views of registry rows: what the repository hands to services."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import datetime

from .dtypes import to_project_dtype
from .models import CheckpointManifestRow, GpuShardRow, ReplicaGroupRow


@dataclass(frozen=True, slots=True)
class ReplicaGroup:
    """One replica group: TP x PP ranks serving one model at one dtype (registry short name)."""

    replica_group_id: uuid.UUID
    model_name: str
    tp_degree: int
    pp_degree: int
    dtype: str
    kv_cache_cap_bytes: int
    status: str
    created_at: datetime
    updated_at: datetime
    name: str | None = None
    endpoint: str | None = None
    status_reason: str | None = None

    @property
    def world_size(self) -> int:
        return self.tp_degree * self.pp_degree

    @property
    def project_dtype(self) -> str:
        """The dtype in the project's naming (``bf16`` -> ``bfloat16``)."""
        return to_project_dtype(self.dtype)

    @classmethod
    def from_row(cls, row: ReplicaGroupRow) -> ReplicaGroup:
        return cls(
            replica_group_id=row.replica_group_id, model_name=row.model_name,
            tp_degree=row.tp_degree, pp_degree=row.pp_degree, dtype=row.dtype,
            kv_cache_cap_bytes=row.kv_cache_cap_bytes, status=row.status,
            created_at=row.created_at, updated_at=row.updated_at, name=row.name,
            endpoint=row.endpoint, status_reason=row.status_reason,
        )


@dataclass(frozen=True, slots=True)
class GpuShard:
    """One rank of a replica group, placed on one GPU. ``global_rank = pp_stage * tp + tp_rank``."""

    gpu_id: str
    replica_group_id: uuid.UUID
    node_id: str
    tp_rank: int
    pp_stage: int
    weight_bytes: int
    kv_used_bytes: int
    last_heartbeat: datetime
    status: str

    @classmethod
    def from_row(cls, row: GpuShardRow) -> GpuShard:
        return cls(
            gpu_id=row.gpu_id, replica_group_id=row.replica_group_id, node_id=row.node_id,
            tp_rank=row.tp_rank, pp_stage=row.pp_stage, weight_bytes=row.weight_bytes,
            kv_used_bytes=row.kv_used_bytes, last_heartbeat=row.last_heartbeat, status=row.status,
        )


@dataclass(frozen=True, slots=True)
class CheckpointManifest:
    """A verified, sharded checkpoint: one per (model_name, dtype, layout), never patched."""

    manifest_id: uuid.UUID
    model_name: str
    dtype: str
    shard_uri_prefix: str
    total_bytes: int
    shard_count: int
    created_at: datetime
    manifest_uri: str | None = None
    tp_degree: int | None = None
    pp_degree: int | None = None

    @classmethod
    def from_row(cls, row: CheckpointManifestRow) -> CheckpointManifest:
        return cls(
            manifest_id=row.manifest_id, model_name=row.model_name, dtype=row.dtype,
            shard_uri_prefix=row.shard_uri_prefix, total_bytes=row.total_bytes,
            shard_count=row.shard_count, created_at=row.created_at,
            manifest_uri=row.manifest_uri, tp_degree=row.tp_degree, pp_degree=row.pp_degree,
        )


def registry_group_id(replica_group_id: str) -> uuid.UUID:
    """The registry's UUID of a replica group: the id itself when it is a UUID, else the stable
    UUID5 of the name (``rg-0-3fa2c1``), so every service that knows a group by its name finds
    the same row."""
    try:
        return uuid.UUID(replica_group_id)
    except ValueError:
        return uuid.uuid5(uuid.NAMESPACE_URL, f"shardline:{replica_group_id}")
