"""What an alert changes outside telemetry: the health store (Redis) and the shard registry.

Runs on its own thread (:class:`EffectWorker`), so a slow Redis or database never holds up
ingest. Per alert:

- health store (``shardhealth:<group>``): COLLECTIVE_TIMEOUT and STAGE_LINK_FAILURE mark every
  rank of the group ``unhealthy`` (the router stops routing there at once); SLOW_RANK and
  STAGE_LINK_FLAP mark the named rank ``degraded`` (and ``healthy`` again on recovery). Ranks
  are written with a heartbeat so a group telemetry saw before its first worker heartbeat still
  gets its mark.
- registry (``replica_groups.status``): timeouts move the group to ``draining`` (the router
  drains and evicts it; the worker, which tears it down, then moves it to ``dead``); SLOW_RANK
  and STAGE_LINK_FLAP move ``healthy`` -> ``degraded`` and back. A move the lifecycle forbids
  (the worker already marked the group dead) or a group the registry does not hold is logged
  and skipped.
"""

from __future__ import annotations

import logging
import queue
import threading
import time

import redis
from sqlalchemy.exc import OperationalError

from services.common.group_status import GroupStatus
from services.common.health import HealthStore, rank_field
from services.common.health.base import DEGRADED, HEALTHY, UNHEALTHY
from services.common.registry import IllegalTransition, NotFound, RegistryError, ShardRegistry, registry_group_id
from services.telemetry.rules import Alert, AlertKind, gpu_coords

log = logging.getLogger(__name__)

# a store down or restarting: the alert is applied again once it is back
STORE_OUTAGE_ERRORS = (redis.ConnectionError, redis.TimeoutError, OperationalError)
RETRY_INTERVAL_S = 0.5
RETRY_FOR_S = 30.0

_REGISTRY_STATUS = {GroupStatus.UNHEALTHY: "draining", GroupStatus.DRAINING: "draining",
                    GroupStatus.DEGRADED: "degraded", GroupStatus.HEALTHY: "healthy"}


def _rank_field_of(gpu_id: str) -> str | None:
    coords = gpu_coords(gpu_id)
    return rank_field(coords[1], coords[0]) if coords else None


class GroupStatusEffects:
    """Applies alerts to the health store and the registry (either may be None)."""

    def __init__(self, health: HealthStore | None = None, registry: ShardRegistry | None = None) -> None:
        self.health = health
        self.registry = registry

    def apply(self, alert: Alert) -> None:
        if self.health is not None:
            self._apply_health(alert)
        if self.registry is not None:
            self._apply_registry(alert)

    def _apply_health(self, alert: Alert) -> None:
        group = alert.replica_group_id
        if alert.kind in (AlertKind.COLLECTIVE_TIMEOUT, AlertKind.STAGE_LINK_FAILURE):
            fields = {f for f in map(_rank_field_of, (*alert.group_gpu_ids, alert.gpu_id)) if f}
            fields.update(self.health.group_health(group))
            if fields:
                self.health.heartbeat(group, dict.fromkeys(sorted(fields), UNHEALTHY))
            else:
                self.health.mark_group(group, UNHEALTHY)
            return
        field = _rank_field_of(alert.gpu_id)
        if field is None:
            return
        current = self.health.group_health(group)
        if current.get(field, HEALTHY) == UNHEALTHY:
            return  # a timed-out group stays unhealthy
        self.health.heartbeat(group, {field: DEGRADED if alert.new_status is GroupStatus.DEGRADED else HEALTHY})

    def _apply_registry(self, alert: Alert) -> None:
        target = _REGISTRY_STATUS[alert.new_status]
        gid = registry_group_id(alert.replica_group_id)
        try:
            current = self.registry.get_group(gid).status
            if current == target:
                return
            self.registry.set_status(gid, target, reason=alert.message[:500], by="telemetry")
        except IllegalTransition as exc:
            log.info("registry: %s stays %s (%s)", alert.replica_group_id, exc.from_status, exc)
        except NotFound:
            log.info("registry: replica group %s (%s) is not registered; alert not recorded there",
                     alert.replica_group_id, gid)


class EffectWorker:
    """A thread that applies alerts in order; errors are logged, never raised into ingest.

    An alert that meets a store down or restarting (connection refused or lost) is tried again
    every ``retry_interval_s`` for up to ``retry_for_s``, the alerts behind it waiting their turn,
    so a Redis or PostgreSQL restart delays a mark instead of dropping it. Applying is idempotent
    (a heartbeat with the same statuses, a status move checked against the current one).
    """

    def __init__(self, effects: GroupStatusEffects, *, retry_interval_s: float = RETRY_INTERVAL_S,
                 retry_for_s: float = RETRY_FOR_S) -> None:
        self.effects = effects
        self.retry_interval_s = retry_interval_s
        self.retry_for_s = retry_for_s
        self._queue: queue.SimpleQueue[Alert | None] = queue.SimpleQueue()
        self._closing = threading.Event()
        self._thread = threading.Thread(target=self._run, name="telemetry-effects", daemon=True)
        self._thread.start()

    def submit(self, alert: Alert) -> None:
        self._queue.put(alert)

    def close(self, timeout_s: float = 5.0) -> None:
        self._closing.set()
        self._queue.put(None)
        self._thread.join(timeout_s)

    def _run(self) -> None:
        while (alert := self._queue.get()) is not None:
            self._apply(alert)

    def _apply(self, alert: Alert) -> None:
        give_up_at = time.monotonic() + self.retry_for_s
        while True:
            try:
                self.effects.apply(alert)
                return
            except STORE_OUTAGE_ERRORS as exc:
                if time.monotonic() >= give_up_at or self._closing.is_set():
                    log.warning("could not apply %s alert for %s (store unreachable for %.0f s): %s",
                                alert.kind.value, alert.replica_group_id, self.retry_for_s, exc)
                    return
                log.info("store unreachable applying %s alert for %s, retrying: %s",
                         alert.kind.value, alert.replica_group_id, exc)
                self._closing.wait(self.retry_interval_s)
            except (RegistryError, OSError, ConnectionError) as exc:
                log.warning("could not apply %s alert for %s: %s", alert.kind.value, alert.replica_group_id, exc)
                return
            except Exception as exc:  # anything else: keep the thread alive
                log.exception("applying %s alert for %s failed: %s", alert.kind.value, alert.replica_group_id, exc)
                return
