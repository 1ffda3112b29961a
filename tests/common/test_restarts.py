"""The stores' clients across a restart of their server: a real Redis and a real PostgreSQL of
this test's own (tests/restartable.py), stopped and started again on the same port. A call
while the server is down fails with the client's error; the first call once it is back succeeds
on the same store object, with no reconnect by the caller."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import redis

from services.common.health import rank_fields
from services.common.health.redis_store import RedisHealthStore
from services.common.registry import ShardRegistry
from tests.restartable import PostgresServer, RedisServer, postgres_server, redis_server

pytestmark = [pytest.mark.slow, pytest.mark.waits]  # on servers restarting (tests/lanes.py)

GROUP = "rg-restart"


@pytest.fixture
def own_redis() -> Iterator[RedisServer]:
    with redis_server() as server:
        yield server


@pytest.fixture
def own_postgres() -> Iterator[PostgresServer]:
    with postgres_server() as server:
        yield server


def test_health_store_reconnects_after_redis_restart(own_redis: RedisServer) -> None:
    store = RedisHealthStore(own_redis.url)
    ranks = dict.fromkeys(rank_fields(2), "healthy")
    store.heartbeat(GROUP, ranks)
    store.set_kv_utilization(GROUP, 0.25)
    assert store.group_health(GROUP) == ranks
    seen_run = store.server_run_id()
    assert seen_run

    own_redis.stop()
    started = time.monotonic()
    with pytest.raises(redis.ConnectionError):
        store.heartbeat(GROUP, ranks)
    assert time.monotonic() - started < 2.0, "a call to a stopped Redis must fail fast, not hang"

    own_redis.start()
    # the pooled connection died with the old server: every kind of call works again at once
    store.heartbeat(GROUP, ranks)
    store.set_kv_utilization(GROUP, 0.5)
    assert store.mark_group(GROUP, "degraded") == 2  # the Lua script is loaded again
    assert store.group_health(GROUP) == dict.fromkeys(ranks, "degraded")
    assert store.kv_utilizations() == {GROUP: 0.5}
    assert store.list_groups() == [GROUP]
    # a reader can tell an entry lost with the restart from one that expired
    assert store.restarted_since(seen_run)
    assert not store.restarted_since(store.server_run_id())  # (an entry seen after the restart)
    store.close()


def test_registry_reconnects_after_postgres_restart(own_postgres: PostgresServer) -> None:
    with ShardRegistry(own_postgres.url, migrate_schema=True) as registry:
        group = registry.create_replica_group("tiny", 1, 1, "float32", 1 << 20, name=GROUP)
        registry.register_shard(group.replica_group_id, f"{GROUP}:pp0-tp0", "node", 0, 0, 1 << 20)
        registry.heartbeat(f"{GROUP}:pp0-tp0", 1)
        before = registry.get_shard(f"{GROUP}:pp0-tp0").last_heartbeat

        own_postgres.stop()
        started = time.monotonic()
        with pytest.raises(Exception) as down:  # noqa: PT011 - the DBAPI error, wrapped by SQLAlchemy
            registry.heartbeat(f"{GROUP}:pp0-tp0", 2)
        assert "OperationalError" in type(down.value).__name__
        assert time.monotonic() - started < 5.0, "a call to a stopped PostgreSQL must fail fast, not hang"

        own_postgres.start()
        registry.heartbeat(f"{GROUP}:pp0-tp0", 3)
        shard = registry.get_shard(f"{GROUP}:pp0-tp0")
        assert shard.kv_used_bytes == 3
        assert shard.last_heartbeat > before


def test_registry_retries_a_transaction_whose_connection_died(own_postgres: PostgresServer) -> None:
    """A connection that passed its checkout ping but died before the statement (the server
    restarted in between) costs one retry, not a failed call."""
    with ShardRegistry(own_postgres.url, migrate_schema=True, pool_pre_ping=False) as registry:
        group = registry.create_replica_group("tiny", 1, 1, "float32", 1 << 20, name=GROUP)
        registry.register_shard(group.replica_group_id, f"{GROUP}:pp0-tp0", "node", 0, 0, 1 << 20)
        own_postgres.stop()
        own_postgres.start()
        # without the checkout ping the pooled connection is handed out dead
        registry.heartbeat(f"{GROUP}:pp0-tp0", 7)
        assert registry.get_shard(f"{GROUP}:pp0-tp0").kv_used_bytes == 7
        assert registry.get_group(group.replica_group_id).name == GROUP


def test_an_entry_lost_with_a_restart_counts_as_expired_after_a_ttl(own_redis: RedisServer) -> None:
    """Right after a restart a missing entry is no news (the writer has not beaten yet); a TTL
    into the new run, missing means expired again. An entry that expires with no restart since
    it was seen is expired at once, however young the server."""
    store = RedisHealthStore(own_redis.url, default_ttl_s=1.0)
    store.heartbeat(GROUP, {"pp0_tp0": "healthy"}, ttl_s=0.3)
    seen_run = store.server_run_id()
    time.sleep(0.5)
    assert store.group_health(GROUP) == {}
    assert not store.restarted_since(seen_run)

    store.heartbeat(GROUP, {"pp0_tp0": "healthy"})
    own_redis.stop()
    own_redis.start()
    assert store.group_health(GROUP) == {}
    assert store.restarted_since(seen_run)
    time.sleep(1.1)
    assert not store.restarted_since(seen_run)
    store.close()
