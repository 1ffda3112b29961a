"""Shard health store: per-rank health with a TTL and per-group KV utilization.

``make_health_store(url)`` picks the implementation: ``redis://`` / ``rediss://`` /
``unix://`` -> RedisHealthStore; None or ``memory://`` -> MemoryHealthStore (embedded default).
The key layout and expiry rules are in ``base.py``.
"""

from __future__ import annotations

from typing import Any

from .base import (
    DEFAULT_TTL_S,
    DEGRADED,
    DRAINING,
    HEALTHY,
    RANK_STATUSES,
    UNHEALTHY,
    HealthStore,
    HealthStoreError,
    InvalidHealthValue,
    parse_rank_field,
    rank_field,
    rank_fields,
)
from .memory import MemoryHealthStore
from .redis_store import RedisHealthStore

REDIS_SCHEMES = ("redis://", "rediss://", "unix://")


def make_health_store(url: str | None, *, default_ttl_s: float = DEFAULT_TTL_S,
                      key_prefix: str = "", **redis_kwargs: Any) -> HealthStore:
    """RedisHealthStore for a Redis URL, MemoryHealthStore for None or ``memory://``.

    ``key_prefix`` and ``redis_kwargs`` (redis-py client options) apply to Redis only.
    """
    if url is None or url == "memory://":
        return MemoryHealthStore(default_ttl_s=default_ttl_s)
    if url.startswith(REDIS_SCHEMES):
        return RedisHealthStore(url, key_prefix=key_prefix, default_ttl_s=default_ttl_s,
                                **redis_kwargs)
    raise InvalidHealthValue(
        f"unsupported health store URL {url!r}: expected memory:// or one of {', '.join(REDIS_SCHEMES)}"
    )


__all__ = [
    "DEFAULT_TTL_S", "DEGRADED", "DRAINING", "HEALTHY", "RANK_STATUSES", "UNHEALTHY",
    "HealthStore", "HealthStoreError", "InvalidHealthValue", "MemoryHealthStore",
    "RedisHealthStore", "make_health_store", "parse_rank_field", "rank_field", "rank_fields",
]
