"""The shard-health store interface and its key layout.

Layout (in Redis; the in-process store keeps the same semantics):

- hash ``shardhealth:<replica_group_id>``: one field per rank, named ``pp{s}_tp{r}``
  (``pp_stage`` s, ``tp_rank`` r; global rank = s * tp + r), value ``healthy`` / ``degraded`` /
  ``unhealthy`` / ``draining``. EXPIRE = the heartbeat TTL (30 s by default), refreshed by every
  heartbeat. The original PP=1 spelling ``tp_rank_<r>`` is accepted and read as ``pp0_tp<r>``.
- sorted set ``replica_kv_util``: member = replica_group_id, score = KV-cache utilization 0..1.

Redis has one TTL per hash, not per field, so a rank that stops reporting while its peers
keep beating would live on in the hash. Each rank's deadline is therefore also kept (Redis:
sorted set ``shardhealth_seen:<group>``, same TTL) and readers drop ranks past their deadline:
after the TTL passes without a heartbeat, the rank disappears, and with the last rank the
group. A field with no recorded deadline (written by hand: HSET + EXPIRE) lives as long as the
hash. ``shardhealth_groups`` (sorted set: group -> deadline) indexes live groups, so listing
never scans the keyspace.

KV utilization entries of groups whose health has expired are *filtered* from
``kv_utilizations()``, not deleted: a group that reports KV usage before its first heartbeat
(or after a short gap) reappears as soon as it beats again. ``remove_group`` deletes them.
"""

from __future__ import annotations

import math
import re
import time
import uuid
from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping

HEALTHY = "healthy"
DEGRADED = "degraded"
UNHEALTHY = "unhealthy"
DRAINING = "draining"
RANK_STATUSES: tuple[str, ...] = (HEALTHY, DEGRADED, UNHEALTHY, DRAINING)

DEFAULT_TTL_S = 30.0

_CANONICAL = re.compile(r"^pp(\d+)_tp(\d+)$")
_SEED_PP1 = re.compile(r"^tp_rank_(\d+)$")


class HealthStoreError(Exception):
    """Base class of the health store's errors."""


class InvalidHealthValue(HealthStoreError, ValueError):
    """A bad rank name, status, TTL or utilization."""


def rank_field(tp_rank: int, pp_stage: int = 0) -> str:
    """The hash field of one rank: ``pp{pp_stage}_tp{tp_rank}``."""
    if tp_rank < 0 or pp_stage < 0:
        raise InvalidHealthValue(f"tp_rank and pp_stage must be >= 0, got {tp_rank}, {pp_stage}")
    return f"pp{pp_stage}_tp{tp_rank}"


def rank_fields(tp_degree: int, pp_degree: int = 1) -> list[str]:
    """Every rank's field of a TP x PP group, in global-rank order."""
    return [rank_field(r, s) for s in range(pp_degree) for r in range(tp_degree)]


def parse_rank_field(name: str) -> tuple[int, int]:
    """``pp1_tp3`` -> (pp_stage=1, tp_rank=3); the original ``tp_rank_3`` -> (0, 3)."""
    if m := _CANONICAL.match(name):
        return int(m.group(1)), int(m.group(2))
    if m := _SEED_PP1.match(name):
        return 0, int(m.group(1))
    raise InvalidHealthValue(f"bad rank field {name!r}: expected 'pp<stage>_tp<rank>' or 'tp_rank_<rank>'")


def canonical_field(name: str) -> str:
    pp_stage, tp_rank = parse_rank_field(name)
    return rank_field(tp_rank, pp_stage)


def _read_key(name: str) -> tuple[int, int, str]:
    try:
        pp_stage, tp_rank = parse_rank_field(name)
    except InvalidHealthValue:
        return (1 << 30, 0, name)  # foreign fields sort last, untouched
    return (pp_stage, tp_rank, "")


def normalize_read(fields: Mapping[str, str]) -> dict[str, str]:
    """Fields as read back: canonical names where they parse, in global-rank order."""
    out: dict[str, str] = {}
    for name in sorted(fields, key=_read_key):
        try:
            out[canonical_field(name)] = fields[name]
        except InvalidHealthValue:
            out[name] = fields[name]
    return out


def check_status(status: str) -> str:
    if status not in RANK_STATUSES:
        raise InvalidHealthValue(f"unknown rank status {status!r}: expected one of {', '.join(RANK_STATUSES)}")
    return status


def check_rank_statuses(rank_statuses: Mapping[str, str]) -> dict[str, str]:
    """Validated, canonical ``{field: status}`` of one heartbeat."""
    if not rank_statuses:
        raise InvalidHealthValue("a heartbeat needs at least one rank status, got none")
    out: dict[str, str] = {}
    for name, status in rank_statuses.items():
        field = canonical_field(name)
        if field in out:
            raise InvalidHealthValue(f"rank {field} given twice in one heartbeat (as {name!r})")
        out[field] = check_status(status)
    return out


def check_ttl(ttl_s: float) -> float:
    if not (isinstance(ttl_s, int | float) and math.isfinite(ttl_s) and ttl_s >= 0.001):
        raise InvalidHealthValue(f"ttl_s must be a finite number >= 0.001, got {ttl_s!r}")
    return float(ttl_s)


def check_ratio(ratio: float) -> float:
    if not (isinstance(ratio, int | float) and math.isfinite(ratio) and 0.0 <= ratio <= 1.0):
        raise InvalidHealthValue(f"KV utilization must be within [0, 1], got {ratio!r}")
    return float(ratio)


def group_key(group_id: str | uuid.UUID) -> str:
    key = str(group_id)
    if not key:
        raise InvalidHealthValue("replica_group_id must be non-empty")
    return key


class HealthStore(ABC):
    """Per-rank health with a TTL, and per-group KV utilization, for router and coordinator."""

    default_ttl_s: float = DEFAULT_TTL_S

    @abstractmethod
    def heartbeat(self, group_id: str | uuid.UUID, rank_statuses: Mapping[str, str],
                  ttl_s: float | None = None) -> None:
        """Set these ranks' statuses and (re)start the group's and these ranks' TTL, atomically."""

    @abstractmethod
    def mark_group(self, group_id: str | uuid.UUID, status: str) -> int:
        """Set every live rank of the group to ``status``, keeping the TTL; returns ranks marked
        (0 when the group has expired or never reported: there is nothing left to mark)."""

    @abstractmethod
    def group_health(self, group_id: str | uuid.UUID) -> dict[str, str]:
        """``{rank field: status}`` of the live ranks, in global-rank order; {} once expired."""

    @abstractmethod
    def set_kv_utilization(self, group_id: str | uuid.UUID, ratio: float) -> None:
        """Record the group's KV-cache utilization (0..1)."""

    @abstractmethod
    def kv_utilizations(self) -> dict[str, float]:
        """``{group: utilization}`` of live groups, least utilized first (ties by group id)."""

    @abstractmethod
    def remove_group(self, group_id: str | uuid.UUID) -> None:
        """Forget the group: its ranks and its KV utilization."""

    @abstractmethod
    def list_groups(self) -> list[str]:
        """Groups with at least one live rank, sorted."""

    def is_healthy(self, group_id: str | uuid.UUID, *, expected: Iterable[str] | None = None) -> bool:
        """True when the group has live ranks and every one is ``healthy``.

        ``expected`` (e.g. ``rank_fields(tp, pp)``) also requires each of those ranks to be
        present: the store alone cannot know a group's size.
        """
        health = self.group_health(group_id)
        if not health or any(status != HEALTHY for status in health.values()):
            return False
        return expected is None or all(canonical_field(f) in health for f in expected)

    def server_run(self) -> tuple[str, float] | None:
        """(id of the server's current run, monotonic time this client first reached that run);
        None for a store that cannot restart under its readers (the in-process one)."""
        return None

    def server_run_id(self) -> str | None:
        run = self.server_run()
        return run[0] if run else None

    def restarted_since(self, run_id: str | None) -> bool:
        """True when the server restarted since the run ``run_id`` (a reader's last read that
        found an entry), less than a TTL ago: the entry is gone with the restart, not expired,
        and comes back with the writer's next heartbeat, so its absence is no news of the group.
        A TTL into the new run, missing means expired again."""
        run = self.server_run()
        return (run is not None and run_id is not None and run[0] != run_id
                and time.monotonic() - run[1] < self.default_ttl_s)

    def close(self) -> None:
        """Release connections (no-op for the in-process store)."""
