"""ShardRegistry: the operations services need on the registry tables.

Every method runs in its own short transaction and returns immutable records (records.py), so
callers never hold ORM objects or sessions. Ids may be given as ``uuid.UUID`` or as strings.
A method whose statement finds its connection dead (the server restarted) runs once more on a
new connection (engine.retry_on_disconnect).
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from typing import Any, TypeVar

from sqlalchemy import Engine, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from services.common.numerics import DEFAULT_NUMERICS, NUMERICS

from . import errors, migrate
from .dtypes import to_registry_dtype
from .engine import make_engine, registry_url, retry_on_disconnect
from .fleet_store import FleetRecords
from .leases import LeaseRecords, check_fence
from .lifecycle import DEAD, GROUP_STATUSES, MOVERS, PROVISIONING, SHARD_STATUSES
from .models import CheckpointManifestRow, GpuShardRow, QualityGateRow, ReplicaGroupRow
from .records import CheckpointManifest, GpuShard, QualityGateResult, ReplicaGroup

GroupId = uuid.UUID | str
Row = TypeVar("Row")

# set_status retries its compare-and-set this often when another writer changes the status
# between our read and our write (each retry re-reads and re-validates the transition)
_CAS_ATTEMPTS = 5


class GroupIsDead(errors.Conflict):
    """Shards cannot be added to a dead replica group; a new group replaces it."""


def _now() -> datetime:
    return datetime.now(UTC)


def _get_row(session: Session, row_type: type[Row], key: object,
             not_found: Callable[[object], Exception]) -> Row:
    """The row of ``row_type`` with primary key ``key``; raises ``not_found(key)`` when there is none."""
    row = session.get(row_type, key)
    if row is None:
        raise not_found(key)
    return row


def _as_uuid(value: GroupId, what: str = "replica_group_id") -> uuid.UUID:
    if isinstance(value, uuid.UUID):
        return value
    try:
        return uuid.UUID(str(value))
    except ValueError:
        raise errors.InvalidValue(f"{what} must be a UUID, got {value!r}") from None


def _require_int(name: str, value: int, minimum: int, *, maximum: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise errors.InvalidValue(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if value < minimum or (maximum is not None and value > maximum):
        upper = "" if maximum is None else f" and <= {maximum}"
        raise errors.InvalidValue(f"{name} must be >= {minimum}{upper}, got {value}")
    return value


def _require_text(name: str, value: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise errors.InvalidValue(f"{name} must be a non-empty string, got {value!r}")
    return value


def _statuses(status: str | Iterable[str] | None, allowed: tuple[str, ...]) -> list[str] | None:
    if status is None:
        return None
    wanted = [status] if isinstance(status, str) else list(status)
    unknown = [s for s in wanted if s not in allowed]
    if unknown:
        raise errors.InvalidValue(f"unknown status {unknown[0]!r}: expected one of {', '.join(allowed)}")
    return wanted


# how long a fenced transaction may sit idle between its statements on PostgreSQL (see fenced())
FENCED_STALL_S = 1.0


class ShardRegistry(FleetRecords, LeaseRecords):
    """Replica groups, their GPU shards and checkpoint manifests (and fleets: FleetRecords), on
    PostgreSQL or SQLite.

    ``url``: ``postgresql+psycopg://...`` or ``sqlite:///PATH``; None means
    SHARDLINE_REGISTRY_URL, else the embedded SQLite file. ``migrate_schema=True`` runs
    ``alembic upgrade head`` first (what the embedded default wants).
    """

    def __init__(self, url: str | None = None, *, migrate_schema: bool = False,
                 fence: tuple[str, int] | None = None, **engine_kwargs: Any) -> None:
        """``fence``: (lease name, term): every transaction first checks that the lease is still
        in that term, and raises ``leases.Fenced`` when it is not (a deposed leader's registry)."""
        self.url = registry_url(url)
        self.engine: Engine = make_engine(self.url, **engine_kwargs)
        self.fence = fence
        if migrate_schema:
            migrate.upgrade(self.engine)

    def close(self) -> None:
        self.engine.dispose()

    def __enter__(self) -> ShardRegistry:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @contextmanager
    def _tx(self) -> Iterator[Session]:
        with Session(self.engine, expire_on_commit=False) as session, session.begin():
            if self.fence is not None:
                check_fence(session, *self.fence)
            yield session

    def fenced(self, name: str, term: int, *, stall_s: float = FENCED_STALL_S) -> ShardRegistry:
        """A registry on the same database whose every transaction is fenced by lease ``name``
        in ``term`` (its own engine: close it when the term ends). On PostgreSQL a transaction of
        it that stalls ``stall_s`` between statements is ended by the server: a holder paused
        inside one (SIGSTOP) would otherwise keep the lease row locked, and no one could take over."""
        kwargs: dict[str, Any] = {}
        if self.engine.dialect.name == "postgresql":
            kwargs["connect_args"] = {"options": f"-c idle_in_transaction_session_timeout={int(stall_s * 1000)}"}
        return ShardRegistry(self.url, fence=(name, term), **kwargs)

    @staticmethod
    def _group_row(session: Session, group_id: uuid.UUID) -> ReplicaGroupRow:
        return _get_row(session, ReplicaGroupRow, group_id, errors.GroupNotFound)

    # ---- replica groups -------------------------------------------------------------------

    @retry_on_disconnect
    def create_replica_group(self, model_name: str, tp_degree: int, pp_degree: int, dtype: str,
                             kv_cache_cap_bytes: int, *, name: str | None = None,
                             endpoint: str | None = None,
                             replica_group_id: GroupId | None = None, fleet_name: str | None = None,
                             fleet_revision: int | None = None, manifest_uri: str | None = None,
                             numerics: str = DEFAULT_NUMERICS) -> ReplicaGroup:
        """A new group in status ``provisioning``. ``dtype`` in project or registry naming; the
        fleet fields say what a fleet controller builds it from; ``numerics`` how it orders its
        layout-dependent sums (services/common/numerics.py)."""
        if numerics not in NUMERICS:
            raise errors.InvalidValue(f"numerics must be one of {', '.join(NUMERICS)}, got {numerics!r}")
        now = _now()
        row = ReplicaGroupRow(
            replica_group_id=uuid.uuid4() if replica_group_id is None else _as_uuid(replica_group_id),
            model_name=_require_text("model_name", model_name),
            tp_degree=_require_int("tp_degree", tp_degree, 1),
            pp_degree=_require_int("pp_degree", pp_degree, 1),
            dtype=to_registry_dtype(dtype),
            kv_cache_cap_bytes=_require_int("kv_cache_cap_bytes", kv_cache_cap_bytes, 0),
            status=PROVISIONING, created_at=now, updated_at=now, name=name, endpoint=endpoint,
            fleet_name=fleet_name, fleet_revision=fleet_revision, manifest_uri=manifest_uri, numerics=numerics,
        )
        try:
            with self._tx() as session:
                session.add(row)
        except IntegrityError as exc:
            raise errors.Conflict(f"replica group {row.replica_group_id} already exists") from exc
        return ReplicaGroup.from_row(row)

    @retry_on_disconnect
    def get_group(self, group_id: GroupId) -> ReplicaGroup:
        with self._tx() as session:
            return ReplicaGroup.from_row(self._group_row(session, _as_uuid(group_id)))

    @retry_on_disconnect
    def list_groups(self, model_name: str | None = None,
                    status: str | Iterable[str] | None = None) -> list[ReplicaGroup]:
        """Groups, oldest first, filtered by model and by one status or a set of statuses."""
        query = select(ReplicaGroupRow)
        if model_name is not None:
            query = query.where(ReplicaGroupRow.model_name == model_name)
        wanted = _statuses(status, GROUP_STATUSES)
        if wanted is not None:
            query = query.where(ReplicaGroupRow.status.in_(wanted))
        query = query.order_by(ReplicaGroupRow.created_at, ReplicaGroupRow.replica_group_id)
        with self._tx() as session:
            return [ReplicaGroup.from_row(row) for row in session.scalars(query)]

    @retry_on_disconnect
    def set_status(self, group_id: GroupId, new_status: str, reason: str | None = None, *,
                   by: str) -> ReplicaGroup:
        """Move a group along its lifecycle as writer ``by`` (``driver``, ``telemetry``, ``fleet``
        or ``operator``: services/common/group_status.py's MOVERS); raises IllegalTransition for
        a move that writer may not make.

        Compare-and-set on the current status, so two writers racing (say telemetry marking
        ``degraded`` while an operator drains) cannot both pass a check made on a stale read.
        """
        gid = _as_uuid(group_id)
        if new_status not in GROUP_STATUSES:
            raise errors.InvalidValue(
                f"unknown replica group status {new_status!r}: expected one of "
                f"{', '.join(GROUP_STATUSES)}"
            )
        if by not in MOVERS:
            raise errors.InvalidValue(f"unknown status writer {by!r}: expected one of {', '.join(MOVERS)}")
        for _ in range(_CAS_ATTEMPTS):
            with self._tx() as session:
                current = self._group_row(session, gid).status
                allowed = MOVERS[by].get(current, ())
                if new_status not in allowed:
                    raise errors.IllegalTransition(gid, current, new_status, allowed)
                result = session.execute(
                    update(ReplicaGroupRow)
                    .where(ReplicaGroupRow.replica_group_id == gid,
                           ReplicaGroupRow.status == current)
                    .values(status=new_status, status_reason=reason, updated_at=_now())
                    .execution_options(synchronize_session=False)
                )
                if result.rowcount == 1:
                    break
        else:
            raise errors.Conflict(f"replica group {gid} changed status concurrently "
                           f"{_CAS_ATTEMPTS} times; gave up moving it to {new_status}")
        return self.get_group(gid)

    @retry_on_disconnect
    def set_endpoint(self, group_id: GroupId, endpoint: str | None) -> ReplicaGroup:
        """Record where the group's driver serves gRPC (None clears it)."""
        with self._tx() as session:
            row = self._group_row(session, _as_uuid(group_id))
            row.endpoint = endpoint
            row.updated_at = _now()
            return ReplicaGroup.from_row(row)

    # ---- gpu shards -----------------------------------------------------------------------

    @retry_on_disconnect
    def register_shard(self, group_id: GroupId, gpu_id: str, node_id: str, tp_rank: int,
                       pp_stage: int, weight_bytes: int) -> GpuShard:
        """Place rank (pp_stage, tp_rank) of a group on ``gpu_id``.

        A GPU serves one group at a time (gpu_id is gpu_shards' primary key): a GPU still listed
        under a live group is a DuplicateShard; one left under a dead group is taken over
        (its row moves to the new group, which is how dead groups' GPUs get re-provisioned).
        """
        gid = _as_uuid(group_id)
        _require_text("gpu_id", gpu_id)
        _require_text("node_id", node_id)
        _require_int("weight_bytes", weight_bytes, 0)
        try:
            with self._tx() as session:
                group = self._group_row(session, gid)
                if group.status == DEAD:
                    raise GroupIsDead(f"replica group {gid} is dead: cannot register gpu {gpu_id} "
                                      "on it; create a new group")
                _require_int("tp_rank", tp_rank, 0, maximum=group.tp_degree - 1)
                _require_int("pp_stage", pp_stage, 0, maximum=group.pp_degree - 1)
                taken = session.scalars(select(GpuShardRow).where(
                    GpuShardRow.replica_group_id == gid, GpuShardRow.tp_rank == tp_rank,
                    GpuShardRow.pp_stage == pp_stage)).first()
                if taken is not None:
                    raise errors.DuplicateShard(
                        f"replica group {gid} already has a shard at pp_stage={pp_stage} "
                        f"tp_rank={tp_rank} (gpu {taken.gpu_id}); cannot also place gpu {gpu_id}")
                now = _now()
                row = session.get(GpuShardRow, gpu_id)
                if row is None:
                    row = GpuShardRow(gpu_id=gpu_id)
                    session.add(row)
                else:
                    owner = self._group_row(session, row.replica_group_id)
                    if owner.status != DEAD:
                        raise errors.DuplicateShard(
                            f"gpu {gpu_id} already serves replica group {owner.replica_group_id} "
                            f"(status {owner.status}) at pp_stage={row.pp_stage} "
                            f"tp_rank={row.tp_rank}; a GPU serves one live group at a time")
                row.replica_group_id = gid
                row.node_id = node_id
                row.tp_rank = tp_rank
                row.pp_stage = pp_stage
                row.weight_bytes = weight_bytes
                row.kv_used_bytes = 0
                row.last_heartbeat = now
                row.status = "starting"
                session.flush()
                return GpuShard.from_row(row)
        except IntegrityError as exc:  # lost a race with a concurrent registration
            raise errors.DuplicateShard(
                f"gpu {gpu_id} at pp_stage={pp_stage} tp_rank={tp_rank} of group {gid} "
                f"conflicts with a concurrent registration: {exc.orig}") from exc

    @retry_on_disconnect
    def heartbeat(self, gpu_id: str, kv_used_bytes: int, *, status: str | None = None) -> None:
        """Record a shard's liveness: last_heartbeat = now, its KV bytes used, its status."""
        _require_int("kv_used_bytes", kv_used_bytes, 0)
        values: dict[str, Any] = {"kv_used_bytes": kv_used_bytes, "last_heartbeat": _now()}
        if status is not None:
            _statuses(status, SHARD_STATUSES)
            values["status"] = status
        with self._tx() as session:
            result = session.execute(
                update(GpuShardRow).where(GpuShardRow.gpu_id == gpu_id).values(**values)
                .execution_options(synchronize_session=False)
            )
            if result.rowcount == 0:
                raise errors.ShardNotFound(gpu_id)

    @retry_on_disconnect
    def get_shard(self, gpu_id: str) -> GpuShard:
        with self._tx() as session:
            return GpuShard.from_row(_get_row(session, GpuShardRow, gpu_id, errors.ShardNotFound))

    @retry_on_disconnect
    def shards_of(self, group_id: GroupId) -> list[GpuShard]:
        """The group's shards in global-rank order (pp_stage, then tp_rank)."""
        gid = _as_uuid(group_id)
        with self._tx() as session:
            self._group_row(session, gid)
            rows = session.scalars(select(GpuShardRow).where(GpuShardRow.replica_group_id == gid)
                                   .order_by(GpuShardRow.pp_stage, GpuShardRow.tp_rank))
            return [GpuShard.from_row(row) for row in rows]

    @retry_on_disconnect
    def stale_shards(self, older_than_s: float, *, include_dead: bool = False) -> list[GpuShard]:
        """Shards whose last heartbeat is more than ``older_than_s`` seconds old.

        Shards of dead groups are left out unless ``include_dead``: nobody expects them to beat.
        """
        if older_than_s < 0:
            raise errors.InvalidValue(f"older_than_s must be >= 0, got {older_than_s}")
        cutoff = _now() - timedelta(seconds=older_than_s)
        query = (select(GpuShardRow).join(ReplicaGroupRow)
                 .where(GpuShardRow.last_heartbeat < cutoff)
                 .order_by(GpuShardRow.replica_group_id, GpuShardRow.pp_stage, GpuShardRow.tp_rank))
        if not include_dead:
            query = query.where(ReplicaGroupRow.status != DEAD)
        with self._tx() as session:
            return [GpuShard.from_row(row) for row in session.scalars(query)]

    # ---- checkpoint manifests -------------------------------------------------------------

    @retry_on_disconnect
    def register_manifest(self, model_name: str, dtype: str, shard_uri_prefix: str,
                          total_bytes: int, shard_count: int, *, manifest_uri: str | None = None,
                          tp_degree: int | None = None, pp_degree: int | None = None,
                          manifest_id: GroupId | None = None) -> CheckpointManifest:
        """Record a written, verified checkpoint layout. A manifest_uri is registered once."""
        row = CheckpointManifestRow(
            manifest_id=uuid.uuid4() if manifest_id is None else _as_uuid(manifest_id, "manifest_id"),
            model_name=_require_text("model_name", model_name), dtype=to_registry_dtype(dtype),
            shard_uri_prefix=_require_text("shard_uri_prefix", shard_uri_prefix),
            total_bytes=_require_int("total_bytes", total_bytes, 0),
            shard_count=_require_int("shard_count", shard_count, 1), created_at=_now(),
            manifest_uri=manifest_uri,
            tp_degree=None if tp_degree is None else _require_int("tp_degree", tp_degree, 1),
            pp_degree=None if pp_degree is None else _require_int("pp_degree", pp_degree, 1),
        )
        try:
            with self._tx() as session:
                if manifest_uri is not None:
                    existing = session.scalars(select(CheckpointManifestRow).where(
                        CheckpointManifestRow.manifest_uri == manifest_uri)).first()
                    if existing is not None:
                        raise errors.DuplicateManifest(
                            f"manifest_uri {manifest_uri} is already registered as manifest "
                            f"{existing.manifest_id}; a new layout needs a new manifest URI")
                session.add(row)
        except IntegrityError as exc:
            raise errors.DuplicateManifest(
                f"manifest {row.manifest_id} (uri {manifest_uri}) conflicts with an existing "
                f"one: {exc.orig}") from exc
        return CheckpointManifest.from_row(row)

    @retry_on_disconnect
    def get_manifest(self, manifest_id: GroupId) -> CheckpointManifest:
        mid = _as_uuid(manifest_id, "manifest_id")
        with self._tx() as session:
            return CheckpointManifest.from_row(_get_row(session, CheckpointManifestRow, mid, errors.ManifestNotFound))

    @retry_on_disconnect
    def get_manifest_by_uri(self, manifest_uri: str) -> CheckpointManifest:
        with self._tx() as session:
            row = session.scalars(select(CheckpointManifestRow).where(
                CheckpointManifestRow.manifest_uri == manifest_uri)).first()
            if row is None:
                raise errors.ManifestNotFound(manifest_uri)
            return CheckpointManifest.from_row(row)

    @retry_on_disconnect
    def list_manifests(self, model_name: str | None = None,
                       dtype: str | None = None) -> list[CheckpointManifest]:
        """Manifests, newest first, filtered by model and dtype (either naming)."""
        query = select(CheckpointManifestRow)
        if model_name is not None:
            query = query.where(CheckpointManifestRow.model_name == model_name)
        if dtype is not None:
            query = query.where(CheckpointManifestRow.dtype == to_registry_dtype(dtype))
        query = query.order_by(CheckpointManifestRow.created_at.desc(),
                               CheckpointManifestRow.manifest_id)
        with self._tx() as session:
            return [CheckpointManifest.from_row(row) for row in session.scalars(query)]

    # ---- quality gate results ------------------------------------------------------------

    @retry_on_disconnect
    def record_gate_result(self, **figures: Any) -> QualityGateResult:
        """Record one verdict; ``figures`` are :class:`QualityGateResult`'s fields but the id and
        the time, which are made here."""
        expected = {f for f in QualityGateResult.__dataclass_fields__} - {"gate_id", "created_at"}
        if set(figures) != expected:
            missing, extra = sorted(expected - set(figures)), sorted(set(figures) - expected)
            raise errors.InvalidValue(f"gate result fields: missing {missing}, unknown {extra}")
        row = QualityGateRow(gate_id=uuid.uuid4(), created_at=_now(), **figures)
        with self._tx() as session:
            session.add(row)
        return QualityGateResult.from_row(row)

    @retry_on_disconnect
    def list_gate_results(self, model_name: str | None = None,
                          candidate: str | None = None) -> list[QualityGateResult]:
        """Verdicts, newest first, filtered by model and candidate."""
        query = select(QualityGateRow)
        if model_name is not None:
            query = query.where(QualityGateRow.model_name == model_name)
        if candidate is not None:
            query = query.where(QualityGateRow.candidate == candidate)
        query = query.order_by(QualityGateRow.created_at.desc(), QualityGateRow.gate_id)
        with self._tx() as session:
            return [QualityGateResult.from_row(row) for row in session.scalars(query)]
