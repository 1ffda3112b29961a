"""The registry's fleet operations: applied specs by revision, rollouts, and groups' origins.

A mixin of :class:`~services.common.registry.repository.ShardRegistry` (one registry object,
one engine), kept apart so the replica-group operations stay readable.
"""

from __future__ import annotations

import json
import uuid
from contextlib import AbstractContextManager
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from services.common.numerics import DEFAULT_NUMERICS

from . import errors
from .dtypes import to_registry_dtype
from .engine import retry_on_disconnect
from .lifecycle import PROVISIONING
from .models import ROLLOUT_STATUSES, FleetRevisionRow, FleetRolloutRow, ReplicaGroupRow
from .records import FleetRevision, FleetRollout, ReplicaGroup

_APPLY_ATTEMPTS = 5  # two applies racing for the next revision number: the loser retries


class FleetNotFound(errors.NotFound):
    def __init__(self, fleet_name: object) -> None:
        super().__init__("fleet", fleet_name)


class FleetRecords:
    """Fleet specs, rollouts and the fleet columns of replica groups."""

    def _tx(self) -> AbstractContextManager[Session]:  # provided by ShardRegistry
        raise NotImplementedError

    # ---- specs -----------------------------------------------------------------------------

    @retry_on_disconnect
    def apply_fleet(self, fleet_name: str, spec_json: str) -> tuple[FleetRevision, bool]:
        """Store ``spec_json`` as the fleet's next revision; (revision, created). Applying the spec
        the newest revision already holds creates nothing."""
        json.loads(spec_json)  # a spec is JSON; the fleet package checks what it says
        for _ in range(_APPLY_ATTEMPTS):
            try:
                with self._tx() as session:
                    newest = session.scalars(select(FleetRevisionRow).where(FleetRevisionRow.fleet_name == fleet_name)
                                             .order_by(FleetRevisionRow.revision.desc()).limit(1)).first()
                    if newest is not None and json.loads(newest.spec) == json.loads(spec_json):
                        return FleetRevision.from_row(newest), False
                    row = FleetRevisionRow(fleet_name=fleet_name, revision=(newest.revision + 1) if newest else 1,
                                           spec=spec_json, created_at=datetime.now(UTC))
                    session.add(row)
                return FleetRevision.from_row(row), True
            except IntegrityError:
                continue
        raise errors.Conflict(f"fleet {fleet_name}: {_APPLY_ATTEMPTS} concurrent applies; gave up")

    @retry_on_disconnect
    def fleet_revision(self, fleet_name: str, revision: int | None = None) -> FleetRevision:
        """A revision of the fleet's spec; the newest when ``revision`` is None."""
        query = select(FleetRevisionRow).where(FleetRevisionRow.fleet_name == fleet_name)
        if revision is not None:
            query = query.where(FleetRevisionRow.revision == revision)
        with self._tx() as session:
            row = session.scalars(query.order_by(FleetRevisionRow.revision.desc()).limit(1)).first()
            if row is None:
                raise FleetNotFound(fleet_name if revision is None else f"{fleet_name} revision {revision}")
            return FleetRevision.from_row(row)

    @retry_on_disconnect
    def list_fleets(self) -> list[str]:
        with self._tx() as session:
            return list(session.scalars(select(FleetRevisionRow.fleet_name).distinct()
                                        .order_by(FleetRevisionRow.fleet_name)))

    @retry_on_disconnect
    def fleet_groups(self, fleet_name: str, *, include_dead: bool = False) -> list[ReplicaGroup]:
        """The fleet's replica groups, oldest first."""
        query = select(ReplicaGroupRow).where(ReplicaGroupRow.fleet_name == fleet_name)
        if not include_dead:
            query = query.where(ReplicaGroupRow.status != "dead")
        query = query.order_by(ReplicaGroupRow.created_at, ReplicaGroupRow.replica_group_id)
        with self._tx() as session:
            return [ReplicaGroup.from_row(row) for row in session.scalars(query)]

    @retry_on_disconnect
    def adopt_provisioning_group(self, group_id: uuid.UUID, *, model_name: str, tp_degree: int, pp_degree: int,
                                 dtype: str, kv_cache_cap_bytes: int, endpoint: str | None,
                                 numerics: str = DEFAULT_NUMERICS) -> ReplicaGroup | None:
        """A group a controller created in ``provisioning`` is taken over by its driver: the
        model name, capacity, endpoint and numerics it runs are recorded. None when there is no such row;
        Conflict when the row is not provisioning or describes another layout. ``dtype`` in project
        or registry naming."""
        dtype = to_registry_dtype(dtype)
        with self._tx() as session:
            row = session.get(ReplicaGroupRow, group_id)
            if row is None:
                return None
            if row.status != PROVISIONING:
                raise errors.Conflict(f"replica group {group_id} is {row.status}, not provisioning: a group is "
                                      f"started once")
            if (row.tp_degree, row.pp_degree, row.dtype) != (tp_degree, pp_degree, dtype):
                raise errors.Conflict(f"replica group {group_id} was declared TP{row.tp_degree} x PP{row.pp_degree} "
                                      f"{row.dtype}, its driver loaded TP{tp_degree} x PP{pp_degree} {dtype}")
            row.numerics = numerics  # what the driver runs (a planner's row does not say)
            row.model_name = model_name
            row.kv_cache_cap_bytes = kv_cache_cap_bytes
            row.endpoint = endpoint
            row.updated_at = datetime.now(UTC)
            return ReplicaGroup.from_row(row)

    # ---- rollouts --------------------------------------------------------------------------

    @retry_on_disconnect
    def create_rollout(self, fleet_name: str, from_revision: int | None, to_revision: int) -> FleetRollout:
        now = datetime.now(UTC)
        row = FleetRolloutRow(rollout_id=uuid.uuid4(), fleet_name=fleet_name, from_revision=from_revision,
                              to_revision=to_revision, status="running", reason="", events="[]",
                              created_at=now, updated_at=now)
        with self._tx() as session:
            session.add(row)
        return FleetRollout.from_row(row)

    @retry_on_disconnect
    def latest_rollout(self, fleet_name: str) -> FleetRollout | None:
        with self._tx() as session:
            row = session.scalars(select(FleetRolloutRow).where(FleetRolloutRow.fleet_name == fleet_name)
                                  .order_by(FleetRolloutRow.created_at.desc()).limit(1)).first()
            return None if row is None else FleetRollout.from_row(row)

    @retry_on_disconnect
    def list_rollouts(self, fleet_name: str) -> list[FleetRollout]:
        """The fleet's rollouts, newest first."""
        with self._tx() as session:
            return [FleetRollout.from_row(row) for row in session.scalars(
                select(FleetRolloutRow).where(FleetRolloutRow.fleet_name == fleet_name)
                .order_by(FleetRolloutRow.created_at.desc(), FleetRolloutRow.rollout_id))]

    @retry_on_disconnect
    def update_rollout(self, rollout_id: uuid.UUID, *, status: str | None = None, reason: str | None = None,
                       event: dict[str, Any] | None = None, only_if: str | None = None) -> FleetRollout | None:
        """Change a rollout's status or reason and append an event; ``only_if``: only while it is in
        that status (None is returned when it was not)."""
        if status is not None and status not in ROLLOUT_STATUSES:
            raise errors.InvalidValue(f"unknown rollout status {status!r}: expected one of "
                                      f"{', '.join(ROLLOUT_STATUSES)}")
        with self._tx() as session:
            row = session.get(FleetRolloutRow, rollout_id)
            if row is None:
                raise errors.NotFound("rollout", rollout_id)
            if only_if is not None and row.status != only_if:
                return None
            if status is not None:
                row.status = status
            if reason is not None:
                row.reason = reason
            if event is not None:
                row.events = json.dumps([*json.loads(row.events), event])
            row.updated_at = datetime.now(UTC)
            return FleetRollout.from_row(row)
