"""A group's poller: a late Stats or health check is not a failure until the report is stale; a
refused one is at once."""

from __future__ import annotations

import time

from services.common.errors import Unavailable
from services.common.group_status import GroupStatus
from services.router.replicas import GroupPoller, ReplicaSet, StatsLate, WorkerStats

STATS = WorkerStats("rg-a", "m", 1, 1, "bfloat16", 0, 1000, 10, 100)


class Source:
    def __init__(self) -> None:
        self.stats_error: Exception | None = None
        self.health_error: Exception | None = None

    def stats(self, timeout_s: float, prefix_cursor: tuple[str, int] | None = None) -> WorkerStats:
        if self.stats_error is not None:
            raise self.stats_error
        return STATS

    def serving(self, timeout_s: float) -> bool:
        if self.health_error is not None:
            raise self.health_error
        return True


def poller(source: Source, stale_after_s: float = 3.0) -> tuple[GroupPoller, ReplicaSet]:
    replicas = ReplicaSet()
    view, _ = replicas.add("127.0.0.1:1")
    return GroupPoller(replicas, view, source, store=None, stale_after_s=stale_after_s), replicas


def test_a_late_stats_or_health_check_keeps_the_last_report_until_it_is_stale() -> None:
    source = Source()
    p, _ = poller(source, stale_after_s=0.3)
    p.poll_once()
    assert p.view.status is GroupStatus.HEALTHY
    source.stats_error = StatsLate("Stats of 127.0.0.1:1: no answer within 0.5 s")
    p.poll_once()
    assert p.view.status is GroupStatus.HEALTHY and p.view.stats_error == ""
    source.stats_error, source.health_error = None, StatsLate("health check: no answer")
    p.poll_once()
    assert p.view.status is GroupStatus.HEALTHY
    source.stats_error = StatsLate("still late")
    time.sleep(0.35)
    p.poll_once()
    assert p.view.status is GroupStatus.UNHEALTHY and "no Stats report" in p.view.status_reason


def test_a_refused_stats_is_unhealthy_at_once() -> None:
    source = Source()
    p, _ = poller(source)
    p.poll_once()
    source.stats_error = Unavailable("Stats of 127.0.0.1:1: UNAVAILABLE: connection refused")
    p.poll_once()
    assert p.view.status is GroupStatus.UNHEALTHY and "connection refused" in p.view.status_reason
