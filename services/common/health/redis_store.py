"""Redis health store (redis-py): the original keys, plus per-rank deadlines (see base.py).

Keys (``key_prefix`` is prepended to each, to share one Redis between deployments or tests):
``shardhealth:<group>`` (hash), ``shardhealth_seen:<group>`` (zset rank -> deadline ms),
``shardhealth_groups`` (zset group -> deadline ms), ``replica_kv_util`` (zset group -> util).
Deadlines are the writer's wall clock in ms; hosts are assumed NTP-synced, so a skew of
d shifts a rank's life by d against a 30 s TTL.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Mapping
from typing import Any

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from . import base

# Marks every live rank of one group, keeping the hash's TTL. A script, so that the existence
# check, the read of deadlines and the writes are atomic, and HSET never recreates an expired
# hash without a TTL. KEYS: hash, seen zset. ARGV: status, now_ms.
_MARK_GROUP_LUA = """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
local marked = 0
for _, f in ipairs(redis.call('HKEYS', KEYS[1])) do
  local deadline = redis.call('ZSCORE', KEYS[2], f)
  if (not deadline) or tonumber(deadline) > tonumber(ARGV[2]) then
    redis.call('HSET', KEYS[1], f, ARGV[1])
    marked = marked + 1
  end
end
return marked
"""


def _now_ms() -> int:
    return time.time_ns() // 1_000_000


class RedisHealthStore(base.HealthStore):
    """Health store on a real Redis server (``redis://host:port/db``)."""

    def __init__(self, url: str, *, key_prefix: str = "", default_ttl_s: float = base.DEFAULT_TTL_S,
                 **client_kwargs: Any) -> None:
        self.url = url
        self.key_prefix = key_prefix
        self.default_ttl_s = base.check_ttl(default_ttl_s)
        client_kwargs.setdefault("decode_responses", True)
        # a server that restarts or goes away must fail a call fast, not hang its caller (a
        # worker's heartbeat, a router's poll): the next call reconnects. A pooled connection
        # the old server closed is replaced at checkout; one that dies mid-command is retried
        # once on a new connection, with no backoff, so a stopped server still fails at once.
        client_kwargs.setdefault("socket_connect_timeout", 2.0)
        client_kwargs.setdefault("socket_timeout", 2.0)
        client_kwargs.setdefault("retry", Retry(NoBackoff(), 1))
        client_kwargs.setdefault("retry_on_error", [redis.ConnectionError, redis.TimeoutError])
        client_kwargs.setdefault("health_check_interval", 10)
        self._run_lock = threading.Lock()
        self._run: tuple[str, float] | None = None
        client_kwargs.setdefault("redis_connect_func", self._on_connect)
        self._client: redis.Redis = redis.Redis.from_url(url, **client_kwargs)
        self._mark_group = self._client.register_script(_MARK_GROUP_LUA)
        self.groups_key = f"{key_prefix}shardhealth_groups"
        self.kv_key = f"{key_prefix}replica_kv_util"

    def health_key(self, group_id: str | uuid.UUID) -> str:
        return f"{self.key_prefix}shardhealth:{base.group_key(group_id)}"

    def seen_key(self, group_id: str | uuid.UUID) -> str:
        return f"{self.key_prefix}shardhealth_seen:{base.group_key(group_id)}"

    def close(self) -> None:
        self._client.close()

    def server_run(self) -> tuple[str, float] | None:
        with self._run_lock:
            return self._run

    def _on_connect(self, connection: redis.Connection) -> None:
        """Every new connection (a restart leaves only new ones) notes which run of the server
        it reached: Redis gives each start a new run_id."""
        connection.on_connect()
        connection.send_command("INFO", "server")
        info = connection.read_response()
        text = info.decode() if isinstance(info, bytes) else str(info)
        run_id = next((line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("run_id:")), "")
        with self._run_lock:
            if self._run is None or self._run[0] != run_id:
                self._run = (run_id, time.monotonic())

    def heartbeat(self, group_id: str | uuid.UUID, rank_statuses: Mapping[str, str],
                  ttl_s: float | None = None) -> None:
        key = base.group_key(group_id)
        fields = base.check_rank_statuses(rank_statuses)
        ttl_ms = max(1, round(base.check_ttl(self.default_ttl_s if ttl_s is None else ttl_s) * 1000))
        deadline = _now_ms() + ttl_ms
        health, seen = self.health_key(key), self.seen_key(key)
        with self._client.pipeline(transaction=True) as pipe:  # MULTI ... EXEC
            pipe.hset(health, mapping=fields)
            pipe.pexpire(health, ttl_ms)
            pipe.zadd(seen, dict.fromkeys(fields, deadline))
            pipe.pexpire(seen, ttl_ms)
            pipe.zadd(self.groups_key, {key: deadline})
            pipe.execute()

    def mark_group(self, group_id: str | uuid.UUID, status: str) -> int:
        base.check_status(status)
        keys = [self.health_key(group_id), self.seen_key(group_id)]
        return int(self._mark_group(keys=keys, args=[status, _now_ms()]))

    def group_health(self, group_id: str | uuid.UUID) -> dict[str, str]:
        with self._client.pipeline(transaction=True) as pipe:
            pipe.hgetall(self.health_key(group_id))
            pipe.zrange(self.seen_key(group_id), 0, -1, withscores=True)
            statuses, seen = pipe.execute()
        now = _now_ms()
        deadlines = dict(seen)
        live = {f: s for f, s in statuses.items() if deadlines.get(f, now + 1) > now}
        return base.normalize_read(live)

    def set_kv_utilization(self, group_id: str | uuid.UUID, ratio: float) -> None:
        self._client.zadd(self.kv_key, {base.group_key(group_id): base.check_ratio(ratio)})

    def kv_utilizations(self) -> dict[str, float]:
        with self._client.pipeline(transaction=True) as pipe:
            pipe.zrange(self.kv_key, 0, -1, withscores=True)
            pipe.zrangebyscore(self.groups_key, f"({_now_ms()}", "+inf")
            utils, live = pipe.execute()
        alive = set(live)
        return {member: float(score) for member, score in utils if member in alive}

    def remove_group(self, group_id: str | uuid.UUID) -> None:
        key = base.group_key(group_id)
        with self._client.pipeline(transaction=True) as pipe:
            pipe.delete(self.health_key(key), self.seen_key(key))
            pipe.zrem(self.groups_key, key)
            pipe.zrem(self.kv_key, key)
            pipe.execute()

    def list_groups(self) -> list[str]:
        now = _now_ms()
        with self._client.pipeline(transaction=True) as pipe:
            pipe.zrangebyscore(self.groups_key, f"({now}", "+inf")
            pipe.zremrangebyscore(self.groups_key, "-inf", now)  # lazy cleanup of expired groups
            live, _ = pipe.execute()
        return sorted(live)
