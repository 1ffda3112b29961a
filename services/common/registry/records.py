"""Plain, immutable views of registry rows: what the repository hands to services."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, fields
from datetime import datetime
from typing import Self

from services.common.numerics import DEFAULT_NUMERICS

from .dtypes import to_project_dtype
from .models import Base


class _FromRow:
    """A record made from its ORM row: every field is the row's column of the same name."""

    __slots__ = ()

    @classmethod
    def from_row(cls, row: Base) -> Self:
        return cls(**{f.name: getattr(row, f.name) for f in fields(cls)})


@dataclass(frozen=True, slots=True)
class ReplicaGroup(_FromRow):
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
    fleet_name: str | None = None
    fleet_revision: int | None = None
    manifest_uri: str | None = None
    numerics: str = DEFAULT_NUMERICS

    @property
    def world_size(self) -> int:
        return self.tp_degree * self.pp_degree

    @property
    def project_dtype(self) -> str:
        """The dtype in the project's naming (``bf16`` -> ``bfloat16``)."""
        return to_project_dtype(self.dtype)


@dataclass(frozen=True, slots=True)
class GpuShard(_FromRow):
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


@dataclass(frozen=True, slots=True)
class CheckpointManifest(_FromRow):
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


@dataclass(frozen=True, slots=True)
class QualityGateResult(_FromRow):
    """One recorded verdict of the golden-set gate (``reasons``: one per line, empty if passed)."""

    gate_id: uuid.UUID
    model_name: str
    reference: str
    candidate: str
    candidate_dtype: str
    text_fingerprint: str
    chunks: int
    scored_tokens: int
    reference_perplexity: float
    candidate_perplexity: float
    perplexity_delta_pct: float
    delta_low_pct: float
    delta_high_pct: float
    mean_abs_logprob_delta: float
    p99_abs_logprob_delta: float
    top1_agreement: float
    threshold_pct: float
    min_top1_agreement: float | None
    passed: bool
    reasons: str
    created_at: datetime


@dataclass(frozen=True, slots=True)
class FleetRevision(_FromRow):
    """One applied fleet spec (its JSON form), numbered per fleet."""

    fleet_name: str
    revision: int
    spec: str
    created_at: datetime


@dataclass(frozen=True, slots=True)
class FleetRollout(_FromRow):
    """One move of a fleet between revisions. ``events``: a JSON list of ``{"t", "event", ...}``."""

    rollout_id: uuid.UUID
    fleet_name: str
    from_revision: int | None
    to_revision: int
    status: str
    reason: str
    events: str
    created_at: datetime
    updated_at: datetime

    @property
    def done(self) -> bool:
        return self.status in ("succeeded", "failed", "aborted")
