"""SQLAlchemy 2 models of the original registry tables, extended (never renamed).

Original columns keep their names and meaning; the extensions are nullable or defaulted so a row
written by the original DDL is still a valid row:

- ``replica_groups``: ``name`` (human label such as ``replica-03``), ``endpoint`` (the driver's
  gRPC address, how the router reaches the group), ``status_reason``, ``updated_at``.
  ``kv_cache_cap_bytes`` is the KV cache cap per GPU, not per group (as the planner means it).
- ``gpu_shards``: ``status`` (what the rank last reported, see ``SHARD_STATUSES``).
- ``checkpoint_manifests``: ``manifest_uri`` (unique), ``tp_degree``, ``pp_degree``.

And tables of our own: ``quality_gate_results``, each verdict of the golden-set gate;
``fleet_revisions``, each applied fleet spec; ``fleet_rollouts``, each move between revisions.
``replica_groups`` also records ``fleet_name``/``fleet_revision``/``manifest_uri``: what a fleet
controller built the group from.

The schema itself is created by the Alembic migration in ``migrations/``; a test checks that the
migrated database and these models agree.
"""

from __future__ import annotations

import uuid
from datetime import UTC, datetime

from sqlalchemy import (
    BigInteger,
    Boolean,
    CheckConstraint,
    DateTime,
    Dialect,
    Double,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    Text,
    UniqueConstraint,
    Uuid,
    text,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column
from sqlalchemy.types import TypeDecorator

from services.common.numerics import DEFAULT_NUMERICS, NUMERICS

from .dtypes import REGISTRY_DTYPES
from .lifecycle import GROUP_STATUSES, SHARD_STATUSES

NAMING_CONVENTION = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

NOW = text("CURRENT_TIMESTAMP")  # now() on PostgreSQL, UTC text on SQLite


def in_list(column: str, values: tuple[str, ...] | list[str]) -> str:
    quoted = ", ".join(f"'{v}'" for v in values)
    return f"{column} IN ({quoted})"


DTYPE_CHECK = in_list("dtype", list(REGISTRY_DTYPES))
GROUP_STATUS_CHECK = in_list("status", GROUP_STATUSES)
SHARD_STATUS_CHECK = in_list("status", SHARD_STATUSES)
NUMERICS_CHECK = in_list("numerics", NUMERICS)


class UTCDateTime(TypeDecorator[datetime]):
    """TIMESTAMPTZ that always hands back aware UTC datetimes, on PostgreSQL and on SQLite.

    SQLite has no time zones: values are stored as naive UTC text (the same as its
    CURRENT_TIMESTAMP), so comparisons in SQL stay correct.
    """

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError(f"expected an aware datetime, got naive {value.isoformat()}")
        value = value.astimezone(UTC)
        return value.replace(tzinfo=None) if dialect.name == "sqlite" else value

    def process_result_value(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)


class ReplicaGroupRow(Base):
    __tablename__ = "replica_groups"

    replica_group_id: Mapped[uuid.UUID] = mapped_column(Uuid, primary_key=True, default=uuid.uuid4)
    model_name: Mapped[str] = mapped_column(Text)
    tp_degree: Mapped[int] = mapped_column(Integer)
    pp_degree: Mapped[int] = mapped_column(Integer)
    dtype: Mapped[str] = mapped_column(Text)
    kv_cache_cap_bytes: Mapped[int] = mapped_column(BigInteger)
    status: Mapped[str] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, server_default=NOW)
    # extensions
    name: Mapped[str | None] = mapped_column(Text)
    endpoint: Mapped[str | None] = mapped_column(Text)
    status_reason: Mapped[str | None] = mapped_column(Text)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime, server_default=NOW)
    # the fleet revision and checkpoint a controller built the group from (None: started by hand)
    fleet_name: Mapped[str | None] = mapped_column(Text)
    fleet_revision: Mapped[int | None] = mapped_column(Integer)
    manifest_uri: Mapped[str | None] = mapped_column(Text)
    # how the group orders its layout-dependent sums (services/common/numerics.py)
    numerics: Mapped[str] = mapped_column(Text, server_default=text(f"'{DEFAULT_NUMERICS}'"))

    __table_args__ = (
        CheckConstraint(DTYPE_CHECK, name="dtype"),
        CheckConstraint(GROUP_STATUS_CHECK, name="status"),
        CheckConstraint(NUMERICS_CHECK, name="numerics"),
        CheckConstraint("tp_degree > 0", name="tp_degree_positive"),
        CheckConstraint("pp_degree > 0", name="pp_degree_positive"),
        CheckConstraint("kv_cache_cap_bytes >= 0", name="kv_cache_cap_nonnegative"),
        Index("idx_replica_groups_model_status", "model_name", "status"),
    )


class GpuShardRow(Base):
    __tablename__ = "gpu_shards"

    gpu_id: Mapped[str] = mapped_column(Text, primary_key=True)
    replica_group_id: Mapped[uuid.UUID] = mapped_column(
        Uuid, ForeignKey("replica_groups.replica_group_id")
    )
    node_id: Mapped[str] = mapped_column(Text)
    tp_rank: Mapped[int] = mapped_column(Integer)
    pp_stage: Mapped[int] = mapped_column(Integer)
    weight_bytes: Mapped[int] = mapped_column(BigInteger)
    kv_used_bytes: Mapped[int] = mapped_column(BigInteger, server_default=text("0"))
    last_heartbeat: Mapped[datetime] = mapped_column(UTCDateTime, server_default=NOW)
    # extension
    status: Mapped[str] = mapped_column(Text, server_default=text("'starting'"))

    __table_args__ = (
        UniqueConstraint("replica_group_id", "tp_rank", "pp_stage"),
        Index("idx_gpu_shards_group", "replica_group_id", "pp_stage", "tp_rank"),
        CheckConstraint(SHARD_STATUS_CHECK, name="status"),
        CheckConstraint("tp_rank >= 0", name="tp_rank_nonnegative"),
        CheckConstraint("pp_stage >= 0", name="pp_stage_nonnegative"),
    )


class CheckpointManifestRow(Base):
    __tablename__ = "checkpoint_manifests"

    manifest_id: Mapped[uuid.UUID] = mapped_column(Uuid, primary_key=True, default=uuid.uuid4)
    model_name: Mapped[str] = mapped_column(Text)
    dtype: Mapped[str] = mapped_column(Text)
    shard_uri_prefix: Mapped[str] = mapped_column(Text)
    total_bytes: Mapped[int] = mapped_column(BigInteger)
    shard_count: Mapped[int] = mapped_column(Integer)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, server_default=NOW)
    # extensions
    manifest_uri: Mapped[str | None] = mapped_column(Text, unique=True)
    tp_degree: Mapped[int | None] = mapped_column(Integer)
    pp_degree: Mapped[int | None] = mapped_column(Integer)

    __table_args__ = (
        CheckConstraint(DTYPE_CHECK, name="dtype"),
        Index("idx_checkpoint_manifests_model_dtype", "model_name", "dtype"),
    )


class QualityGateRow(Base):
    """One verdict of the golden-set gate: the two plans, the figures, pass or fail and why."""

    __tablename__ = "quality_gate_results"

    gate_id: Mapped[uuid.UUID] = mapped_column(Uuid, primary_key=True, default=uuid.uuid4)
    model_name: Mapped[str] = mapped_column(Text)
    reference: Mapped[str] = mapped_column(Text)  # a plan spec, a manifest URI or a replica group
    candidate: Mapped[str] = mapped_column(Text)
    candidate_dtype: Mapped[str] = mapped_column(Text)
    text_fingerprint: Mapped[str] = mapped_column(Text)
    chunks: Mapped[int] = mapped_column(Integer)
    scored_tokens: Mapped[int] = mapped_column(Integer)
    reference_perplexity: Mapped[float] = mapped_column(Double)
    candidate_perplexity: Mapped[float] = mapped_column(Double)
    perplexity_delta_pct: Mapped[float] = mapped_column(Double)
    delta_low_pct: Mapped[float] = mapped_column(Double)
    delta_high_pct: Mapped[float] = mapped_column(Double)
    mean_abs_logprob_delta: Mapped[float] = mapped_column(Double)
    p99_abs_logprob_delta: Mapped[float] = mapped_column(Double)
    top1_agreement: Mapped[float] = mapped_column(Double)
    threshold_pct: Mapped[float] = mapped_column(Double)
    min_top1_agreement: Mapped[float | None] = mapped_column(Double)
    passed: Mapped[bool] = mapped_column(Boolean)
    reasons: Mapped[str] = mapped_column(Text, server_default=text("''"))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, server_default=NOW)

    __table_args__ = (
        CheckConstraint("chunks > 0", name="chunks_positive"),
        Index("idx_quality_gate_results_model_candidate", "model_name", "candidate", "created_at"),
    )


ROLLOUT_STATUSES = ("running", "succeeded", "failed", "aborting", "aborted")


class FleetRevisionRow(Base):
    """One applied fleet spec (JSON): revisions count 1, 2, ... per fleet and are never edited."""

    __tablename__ = "fleet_revisions"

    fleet_name: Mapped[str] = mapped_column(Text, primary_key=True)
    revision: Mapped[int] = mapped_column(Integer, primary_key=True)
    spec: Mapped[str] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, server_default=NOW)

    __table_args__ = (CheckConstraint("revision > 0", name="revision_positive"),)


class FleetRolloutRow(Base):
    """One move of a fleet between revisions: its state, why, and what happened (JSON events)."""

    __tablename__ = "fleet_rollouts"

    rollout_id: Mapped[uuid.UUID] = mapped_column(Uuid, primary_key=True, default=uuid.uuid4)
    fleet_name: Mapped[str] = mapped_column(Text)
    from_revision: Mapped[int | None] = mapped_column(Integer)
    to_revision: Mapped[int] = mapped_column(Integer)
    status: Mapped[str] = mapped_column(Text)
    reason: Mapped[str] = mapped_column(Text, server_default=text("''"))
    events: Mapped[str] = mapped_column(Text, server_default=text("'[]'"))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, server_default=NOW)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime, server_default=NOW)

    __table_args__ = (
        CheckConstraint(in_list("status", ROLLOUT_STATUSES), name="status"),
        Index("idx_fleet_rollouts_fleet", "fleet_name", "created_at"),
    )


class LeaseRow(Base):
    """A leadership lease (one fleet controller acts at a time): who holds it, in which term, and
    how many times it renewed it. Observers judge expiry on their own clocks, from how long the
    (holder, term, renewals) they read stays the same; ``renewed_at`` is for people, not for that.
    ``term`` rises by one with every new holder: a write fenced by an older term is refused."""

    __tablename__ = "leases"

    name: Mapped[str] = mapped_column(Text, primary_key=True)
    holder: Mapped[str] = mapped_column(Text)  # "" once released: the next observer may take it at once
    term: Mapped[int] = mapped_column(BigInteger)
    renewals: Mapped[int] = mapped_column(BigInteger, server_default=text("0"))
    ttl_s: Mapped[float] = mapped_column(Double)
    renewed_at: Mapped[datetime] = mapped_column(UTCDateTime, server_default=NOW)

    __table_args__ = (CheckConstraint("term > 0", name="term_positive"),
                      CheckConstraint("ttl_s > 0", name="ttl_positive"))
