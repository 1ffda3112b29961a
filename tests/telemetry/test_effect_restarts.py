"""Telemetry's effects while the health store's Redis restarts: an alert that arrives while
Redis is down is applied once it is back, not dropped (a real Redis of this test's own)."""

from __future__ import annotations

import time

import pytest

from services.common.group_status import GroupStatus
from services.common.health.redis_store import RedisHealthStore
from services.telemetry.effects import EffectWorker, GroupStatusEffects
from services.telemetry.rules import Alert, AlertKind
from tests.restartable import redis_server

pytestmark = [pytest.mark.slow, pytest.mark.waits]  # on a Redis restart (tests/lanes.py)


def test_an_alert_during_a_redis_outage_is_applied_after_the_restart() -> None:
    with redis_server() as own_redis:
        store = RedisHealthStore(own_redis.url)
        store.heartbeat("rg-a", {"pp0_tp0": "healthy", "pp0_tp1": "healthy"})
        worker = EffectWorker(GroupStatusEffects(health=store))
        try:
            own_redis.stop()
            worker.submit(Alert(AlertKind.COLLECTIVE_TIMEOUT, "rg-a", "rg-a:pp0-tp1", "all_reduce",
                                GroupStatus.UNHEALTHY, "all_reduce timed out", int(time.time() * 1000),
                                group_gpu_ids=("rg-a:pp0-tp0", "rg-a:pp0-tp1")))
            time.sleep(1.0)  # the worker tries while Redis is down
            own_redis.start()
            deadline = time.monotonic() + 5
            while store.group_health("rg-a") != {"pp0_tp0": "unhealthy", "pp0_tp1": "unhealthy"}:
                assert time.monotonic() < deadline, f"the alert was not applied: {store.group_health('rg-a')}"
                time.sleep(0.05)
        finally:
            worker.close()
            store.close()
