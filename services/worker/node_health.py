"""Health heartbeats of a group that spans nodes, and which node a failure lost.

A driver that spawned its followers beats for every rank: they live and die with its host. When
the ranks are on several nodes, each rank beats for itself with a short TTL (NODE_TTL_S), and the
driver for its own node's ranks, so a node that dies or hangs stops renewing its ranks' entries.
When the driver's collectives fail, the group is marked unhealthy at once; the ranks whose
entries then run out name the node(s) that stopped (:func:`failed_nodes`), and the registry's
``status_reason`` says which.

A hung node (its ranks stopped, their sockets open) shows only as timeouts. A stage-boundary
send/recv gets one retry, a second timeout, for a link that flaps; waiting it out for a node
that is gone would double the time to fail. :class:`NodeWatchdog` watches the driver's
coordinator: once such an op is in its retry and another node's entries have run out, it gives
up on the op and fails the group then.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence

from services.common.health.base import HealthStore, rank_field
from services.modeling.parallel.coordinator import Coordinator, ShardGroupUnhealthy

log = logging.getLogger(__name__)

HEARTBEAT_S = 1.0
NODE_TTL_S = 3.0  # a rank's entry outlives its last beat by this much


def rank_fields_of(ranks: Sequence[int], tp: int) -> list[str]:
    return [rank_field(r % tp, r // tp) for r in ranks]


def beat(health: HealthStore, group_id: str, fields: Sequence[str], ttl_s: float | None = NODE_TTL_S) -> None:
    """Renew ``fields`` (for ``ttl_s``; None: the store's default), keeping what others judged:
    telemetry marks a slow rank degraded, and a heartbeat refreshes liveness, it does not
    overrule a diagnosis."""
    current = health.group_health(group_id)
    health.heartbeat(group_id, {f: current.get(f, "healthy") for f in fields}, ttl_s=ttl_s)


class RankHeartbeat:
    """A follower rank's own heartbeat, on a thread, until :meth:`stop`."""

    def __init__(self, health: HealthStore, group_id: str, fields: Sequence[str]) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(health, group_id, list(fields)),
                                        name="rank-heartbeat", daemon=True)
        self._thread.start()

    def _run(self, health: HealthStore, group_id: str, fields: list[str]) -> None:
        while True:
            try:
                beat(health, group_id, fields)
            except Exception as exc:  # the store restarting: the next beat retries
                log.warning("rank heartbeat failed: %s", exc)
            if self._stop.wait(HEARTBEAT_S):
                return

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


def silent_nodes(health: HealthStore, group_id: str, node_ids: Sequence[str], tp: int) -> list[str]:
    """The other nodes (not node_ids[0], the caller's) with a rank whose entry has run out now."""
    live = health.group_health(group_id)
    return sorted({node_ids[r] for r, f in enumerate(rank_fields_of(range(len(node_ids)), tp))
                   if f not in live and node_ids[r] != node_ids[0]})


def failed_nodes(health: HealthStore, group_id: str, node_ids: Sequence[str], tp: int,
                 wait_s: float = NODE_TTL_S + HEARTBEAT_S) -> list[str]:
    """:func:`silent_nodes`, waiting up to ``wait_s`` for one (an entry lives NODE_TTL_S past
    its node's last beat); [] when every node still reports. The caller's own ranks are renewed
    meanwhile, so that its node is not the first to run out."""
    own = [f for r, f in enumerate(rank_fields_of(range(len(node_ids)), tp)) if node_ids[r] == node_ids[0]]
    deadline = time.monotonic() + wait_s
    while True:
        beat(health, group_id, own)
        missing = silent_nodes(health, group_id, node_ids, tp)
        if missing or time.monotonic() >= deadline:
            return missing
        time.sleep(0.2)


class NodeWatchdog:
    """The driver's watch over a group on several nodes (a thread, until :meth:`stop`): while
    the coordinator is in a stage-boundary op's retry and another node stopped reporting, give up
    on the op and call ``on_lost(failure, nodes)`` once."""

    PERIOD_S = 0.2

    def __init__(self, coordinator: Coordinator, health: HealthStore, group_id: str, node_ids: Sequence[str],
                 tp: int, on_lost: Callable[[ShardGroupUnhealthy, list[str]], None]) -> None:
        self._stop = threading.Event()
        self._args = (coordinator, health, group_id, list(node_ids), tp, on_lost)
        self._thread = threading.Thread(target=self._run, name="node-watchdog", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        coordinator, health, group_id, node_ids, tp, on_lost = self._args
        while not self._stop.wait(self.PERIOD_S):
            if coordinator.failure is not None:
                return
            if not coordinator.in_retry():
                continue
            try:
                lost = silent_nodes(health, group_id, node_ids, tp)
            except Exception as exc:  # the store restarting: the retry runs its course meanwhile
                log.warning("node watchdog could not read the health store: %s", exc)
                continue
            if lost:
                failure = coordinator.give_up(f"node {', '.join(lost)} stopped reporting")
                if failure is not None:
                    on_lost(failure, lost)
                    return

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
