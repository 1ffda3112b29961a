"""Giving up on a stage-boundary op whose peer's node stopped reporting: the coordinator's
``give_up`` and the driver's NodeWatchdog, with a hung transfer standing in for a stopped host."""

from __future__ import annotations

import threading
import time

import pytest

from services.common.health import MemoryHealthStore
from services.modeling.parallel.coordinator import Coordinator, ShardGroupUnhealthy
from services.modeling.parallel.groups import ParallelGroups
from services.worker.node_health import NodeWatchdog, beat, rank_fields_of

pytestmark = pytest.mark.waits  # on hung transfers given up on (tests/lanes.py)

TIMEOUT_S = 0.3


class HungWork:
    """A send/recv whose peer never answers: ``wait`` runs out its timeout, as gloo's does."""

    def wait(self, timeout):
        time.sleep(timeout.total_seconds())
        raise RuntimeError(f"Timed out waiting {timeout.total_seconds() * 1e3:.0f}ms for recv operation to complete")


def _coordinator() -> Coordinator:
    groups = ParallelGroups(1, 2, 0, "gloo", None, None, None)
    return Coordinator(groups, replica_group_id="rg", timeout_s=TIMEOUT_S)


def _blocked_recv(coordinator: Coordinator) -> tuple[threading.Thread, list]:
    """A recv on a thread of its own, blocked in its wait; what it raised goes in the list."""
    raised: list = []

    def run() -> None:
        try:
            coordinator._run("recv", 64, 2, HungWork, None)
        except ShardGroupUnhealthy as exc:
            raised.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    return thread, raised


def test_give_up_fails_the_group_only_once_the_op_is_in_its_retry():
    coordinator = _coordinator()
    thread, raised = _blocked_recv(coordinator)
    time.sleep(TIMEOUT_S / 3)
    assert not coordinator.in_retry() and coordinator.give_up("node n1 stopped reporting") is None
    while not coordinator.in_retry():  # the first wait ran out: the op is waiting out its retry
        time.sleep(0.01)
    failure = coordinator.give_up("node n1 stopped reporting")
    assert failure is not None and coordinator.failure is failure
    assert str(failure).startswith(f"replica group rg is unhealthy: recv on rg:pp0-tp0 timed out after {TIMEOUT_S:g} "
                                   f"s and was not retried: node n1 stopped reporting (gave up after 0.")
    assert coordinator.give_up("again") is None  # once
    thread.join(timeout=5)
    assert raised == [failure]  # the blocked call raised the same failure when its wait ended
    events = coordinator.sink.snapshot()
    assert len(events) == 1  # the op, recorded when given up on; nothing more when its wait ended
    assert events[0].op_type == "recv" and events[0].timed_out and events[0].peer_lost
    assert TIMEOUT_S * 1e3 <= events[0].duration_ms < 2 * TIMEOUT_S * 1e3


@pytest.mark.parametrize("node1_beats", [False, True], ids=["node1-stopped", "node1-reporting"])
def test_the_watchdog_gives_up_when_the_peers_node_stopped_reporting(node1_beats):
    health = MemoryHealthStore()
    nodes = ["h-node0", "h-node1"]
    beat(health, "rg", rank_fields_of([0], 1))  # the driver's own node; node 1's entry absent or live
    if node1_beats:
        beat(health, "rg", rank_fields_of([1], 1), ttl_s=30)
    coordinator = _coordinator()
    lost: list = []
    watchdog = NodeWatchdog(coordinator, health, "rg", nodes, 1, lambda failure, names: lost.append((failure, names)))
    try:
        thread, raised = _blocked_recv(coordinator)
        thread.join(timeout=5)
    finally:
        watchdog.stop()
    if node1_beats:  # a live peer node: the retry runs its course (a link flap), the op times out twice
        assert lost == [] and "and again after its retry" in str(raised[0])
        assert [e.peer_lost for e in coordinator.sink.snapshot()] == [False, False]
    else:
        assert [names for _, names in lost] == [["h-node1"]] and raised == [lost[0][0]]
        assert "not retried: node h-node1 stopped reporting" in str(raised[0])
