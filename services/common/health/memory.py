"""In-process health store for the embedded default: Redis's semantics in a dict and a lock."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from . import base


@dataclass
class _GroupHealth:
    statuses: dict[str, str] = field(default_factory=dict)
    deadlines: dict[str, float] = field(default_factory=dict)  # per rank, monotonic seconds
    expires_at: float = 0.0  # the whole group's, as Redis's EXPIRE on the hash

    def live(self, now: float) -> dict[str, str]:
        if self.expires_at <= now:
            return {}
        return {f: s for f, s in self.statuses.items() if self.deadlines[f] > now}


class MemoryHealthStore(base.HealthStore):
    """Thread-safe, process-local; expiry on the monotonic clock (``clock`` for tests)."""

    def __init__(self, *, default_ttl_s: float = base.DEFAULT_TTL_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.default_ttl_s = base.check_ttl(default_ttl_s)
        self._clock = clock
        self._lock = threading.Lock()
        self._groups: dict[str, _GroupHealth] = {}
        self._kv_util: dict[str, float] = {}

    def _live_group(self, key: str, now: float) -> _GroupHealth | None:
        """The group if it has not expired; an expired one is dropped (lock held)."""
        group = self._groups.get(key)
        if group is not None and group.expires_at <= now:
            del self._groups[key]
            return None
        return group

    def heartbeat(self, group_id: str | uuid.UUID, rank_statuses: Mapping[str, str],
                  ttl_s: float | None = None) -> None:
        key = base.group_key(group_id)
        fields = base.check_rank_statuses(rank_statuses)
        ttl = base.check_ttl(self.default_ttl_s if ttl_s is None else ttl_s)
        with self._lock:
            now = self._clock()
            group = self._live_group(key, now) or self._groups.setdefault(key, _GroupHealth())
            deadline = now + ttl
            group.statuses.update(fields)
            group.deadlines.update(dict.fromkeys(fields, deadline))
            group.expires_at = deadline

    def mark_group(self, group_id: str | uuid.UUID, status: str) -> int:
        key = base.group_key(group_id)
        base.check_status(status)
        with self._lock:
            now = self._clock()
            group = self._live_group(key, now)
            if group is None:
                return 0
            live = group.live(now)
            for name in live:
                group.statuses[name] = status
            return len(live)

    def group_health(self, group_id: str | uuid.UUID) -> dict[str, str]:
        key = base.group_key(group_id)
        with self._lock:
            now = self._clock()
            group = self._live_group(key, now)
            return {} if group is None else base.normalize_read(group.live(now))

    def set_kv_utilization(self, group_id: str | uuid.UUID, ratio: float) -> None:
        key = base.group_key(group_id)
        value = base.check_ratio(ratio)
        with self._lock:
            self._kv_util[key] = value

    def kv_utilizations(self) -> dict[str, float]:
        with self._lock:
            now = self._clock()
            live = {k: v for k, v in self._kv_util.items() if self._live_group(k, now) is not None}
        return dict(sorted(live.items(), key=lambda item: (item[1], item[0])))

    def remove_group(self, group_id: str | uuid.UUID) -> None:
        key = base.group_key(group_id)
        with self._lock:
            self._groups.pop(key, None)
            self._kv_util.pop(key, None)

    def list_groups(self) -> list[str]:
        with self._lock:
            now = self._clock()
            return sorted(k for k in list(self._groups) if self._live_group(k, now) is not None)
