"""The router's view of its replica groups, kept fresh by one poller thread per group.

Each poller calls the group's WorkerService ``Stats`` (and its gRPC health check) every
``poll_interval_s`` (0.25 s by default, so a view is never older than the 500 ms the routing
contract allows), mirrors the KV utilization into the health store's ``replica_kv_util``, and
reads the group's rank health back from the store. A group gets new requests only while its
:attr:`ReplicaGroupView.status` is HEALTHY or DEGRADED, which needs all of:

- a recent successful Stats report, and the worker's health check SERVING;
- the worker not draining (Stats) and not dead or draining in the registry (when discovered there);
- no rank ``unhealthy`` or ``draining`` in the health store, and, for a group that has reported to
  the store at least once, its entry not expired (heartbeats stopped). A group that never wrote to
  the store (a worker started without --redis-url) is judged by its Stats alone; while the store
  is unreachable, or restarted less than a TTL ago and empty, the last status read stands;
- the router not having seen one of its streams fail (a failed group is never reused).

No gRPC here: the poller talks to workers through :class:`StatsSource`, which
``worker_client.py`` implements.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Protocol

from services.common.group_status import GroupStatus
from services.common.health import HealthStore

log = logging.getLogger(__name__)

DEFAULT_POLL_INTERVAL_S = 0.25
# A view older than this (the worker stopped answering Stats) is unhealthy.
DEFAULT_STALE_AFTER_S = 3.0


class StatsLate(Exception):
    """A worker's Stats or health check did not answer within the poll's timeout (a busy host, a
    long prefill): not yet a failure. Its last report stands until it is stale, which the stale
    rule judges."""


@dataclass(frozen=True)
class WorkerStats:
    """One worker ``Stats`` answer, in domain form."""

    replica_group_id: str
    model_name: str
    tp_degree: int
    pp_degree: int
    dtype: str
    kv_bytes_used: int
    kv_bytes_capacity: int
    kv_bytes_per_token: int
    max_model_len: int
    running: int = 0
    waiting: int = 0
    blocks_used: int = 0
    blocks_total: int = 0
    draining: bool = False
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache (since the worker started)
    prefix_cache_hits: int = 0  # ... and found there
    blocks_cached: int = 0
    prefix_cache_evictions: int = 0
    block_size: int = 0
    # the prefix-cache events after the cursor the poll sent (worker/engine/prefix_events.py);
    # empty epoch: the worker caches no prefixes
    prefix_epoch: str = ""
    prefix_seq: int = 0
    prefix_snapshot: bool = False
    prefix_events: list[tuple[bytes, bool]] = field(default_factory=list)
    kv_bytes_admitted: int = 0  # Σ KV claims of the requests the group holds, from every router
    num_preemptions: int = 0  # since the worker started


class StatsSource(Protocol):
    """What a poller needs from a worker (``worker_client.WorkerClient`` implements it)."""

    def stats(self, timeout_s: float, prefix_cursor: tuple[str, int] | None = None) -> WorkerStats:
        """The worker's Stats; with ``prefix_cursor`` (epoch, seq) also its prefix-cache events
        after it."""

    def serving(self, timeout_s: float) -> bool: ...


class PrefixIndex:
    """Which groups' prefix caches hold each block name: the router's mirror of every group's
    cache, kept by the groups' views as their Stats bring events, read by the pick (one set
    intersection per block of a prompt instead of a lookup per group). Mutated under the
    replica set's lock."""

    def __init__(self) -> None:
        self.holders: dict[bytes, set[ReplicaGroupView]] = {}

    def add(self, view: ReplicaGroupView, name: bytes) -> None:
        holders = self.holders.get(name)
        if holders is None:
            self.holders[name] = {view}
        else:
            holders.add(view)

    def remove(self, view: ReplicaGroupView, name: bytes) -> None:
        holders = self.holders.get(name)
        if holders is not None:
            holders.discard(view)
            if not holders:
                del self.holders[name]


@dataclass(eq=False)
class ReplicaGroupView:
    """What the router knows of one replica group. Mutated only under ``ReplicaSet.lock``.

    ``kv_bytes_*`` are per GPU of the group's fullest stage, as the worker reports them.
    ``reservations`` are the router's admitted, unfinished requests on this group.
    """

    address: str
    replica_group_id: str = ""
    model: str = ""
    tp_degree: int = 0
    pp_degree: int = 0
    dtype: str = ""
    kv_bytes_used: int = 0
    kv_bytes_capacity: int = 0
    kv_bytes_per_token: int = 0
    max_model_len: int = 0
    running: int = 0
    waiting: int = 0
    prefix_cache: tuple[int, int, int, int] = (0, 0, 0, 0)  # queries, hits, cached blocks, evictions
    preemptions: int = 0  # sequences the group preempted since its worker started
    # the names of the blocks the group's prefix cache holds (services/common/prefix_blocks.py),
    # mirrored from its events, and the cursor of the next poll; block_size: tokens per block
    block_size: int = 0
    prefix_blocks: set[bytes] = field(default_factory=set)
    prefix_epoch: str = ""
    prefix_seq: int = 0
    prefix_index: PrefixIndex | None = field(default=None, repr=False)  # the replica set's, kept in step
    status: GroupStatus = GroupStatus.PROVISIONING
    status_reason: str = ""
    last_report_ms: int = 0  # Unix ms of the last successful Stats
    reported_at: float = 0.0  # monotonic seconds of the same
    reservations: dict[int, Reservation] = field(default_factory=dict)
    # inputs of the status, kept so that each source can change on its own
    draining: bool = False
    worker_serving: bool = True
    stats_error: str = ""
    store_seen: bool = False
    store_status: str | None = None  # worst live rank status; None: no live ranks
    registry_status: str | None = None
    failed: str = ""  # set when one of our streams saw the group fail; sticky per group id
    # running sums over ``reservations`` (the pick reads them for every group on every request)
    kv_bytes_reserved: int = 0  # Σ estimates of our unfinished requests here
    kv_bytes_materialized: int = 0  # Σ of their parts already inside kv_bytes_used
    # the claims the group had admitted at the last report beyond ours (other routers'), or the
    # whole capacity after the worker refused one of ours as full, until the next report
    kv_bytes_claimed_elsewhere: int = 0
    shadow_scores: int = 0  # the shadow mirror's Scores running there now (the pick avoids the group)
    routable: bool = False  # status.routable, kept as a plain bool for the pick's inner loop

    def __post_init__(self) -> None:
        self.routable = self.status.routable

    def add_reservation(self, reservation: Reservation) -> None:
        self.reservations[reservation.reservation_id] = reservation
        self.kv_bytes_reserved += reservation.kv_bytes
        self.kv_bytes_materialized += reservation.materialized_bytes

    def remove_reservation(self, reservation: Reservation) -> None:
        if self.reservations.pop(reservation.reservation_id, None) is not None:
            self.kv_bytes_reserved -= reservation.kv_bytes
            self.kv_bytes_materialized -= reservation.materialized_bytes

    @property
    def outstanding_bytes(self) -> int:
        """The part of our reservations the worker's last report does not include yet."""
        return self.kv_bytes_reserved - self.kv_bytes_materialized

    @property
    def committed_bytes(self) -> int:
        """KV bytes in use at the last report plus what our requests may still claim, or, when
        more, the claims admitted through other routers plus ours (the worker's own rule)."""
        return max(self.kv_bytes_used + self.kv_bytes_reserved - self.kv_bytes_materialized,
                   self.kv_bytes_claimed_elsewhere + self.kv_bytes_reserved)

    @property
    def headroom_bytes(self) -> int:
        return self.kv_bytes_capacity - self.committed_bytes

    @property
    def utilization(self) -> float:
        """committed / capacity: the routing key (reservations counted)."""
        return self.committed_bytes / self.kv_bytes_capacity if self.kv_bytes_capacity else 1.0

    @property
    def token_limit(self) -> int:
        """Longest prompt + completion this group can ever take (context and total KV)."""
        if not self.kv_bytes_per_token:
            return 0
        return min(self.max_model_len, self.kv_bytes_capacity // self.kv_bytes_per_token)

    def apply_stats(self, stats: WorkerStats, *, now: float, wall_ms: int) -> None:
        if self.replica_group_id and stats.replica_group_id != self.replica_group_id:
            # a new group behind the same address: nothing of the old one carries over
            log.info("%s now serves group %s (was %s)", self.address, stats.replica_group_id, self.replica_group_id)
            self.failed, self.store_seen, self.store_status, self.registry_status = "", False, None, None
        self.replica_group_id = stats.replica_group_id
        self.model = stats.model_name
        self.tp_degree, self.pp_degree, self.dtype = stats.tp_degree, stats.pp_degree, stats.dtype
        self.kv_bytes_used = stats.kv_bytes_used
        self.kv_bytes_capacity = stats.kv_bytes_capacity
        self.kv_bytes_per_token = stats.kv_bytes_per_token
        self.max_model_len = stats.max_model_len
        self.running, self.waiting, self.draining = stats.running, stats.waiting, stats.draining
        self.prefix_cache = (stats.prefix_cache_queries, stats.prefix_cache_hits, stats.blocks_cached,
                             stats.prefix_cache_evictions)
        self.preemptions = stats.num_preemptions
        self.block_size = stats.block_size
        self.apply_prefix_events(stats)
        self.reported_at, self.last_report_ms, self.stats_error = now, wall_ms, ""
        # what our requests hold now is in kv_bytes_used from here on
        total = 0
        for reservation in self.reservations.values():
            reservation.materialized_bytes = reservation.in_cache_bytes()
            total += reservation.materialized_bytes
        self.kv_bytes_materialized = total
        self.kv_bytes_claimed_elsewhere = max(0, stats.kv_bytes_admitted - self.kv_bytes_reserved)

    def forget_prefixes(self) -> None:
        """Drop the mirror of the group's prefix cache (its names leave the index); the next
        poll's cursor asks for a snapshot."""
        if self.prefix_index is not None:
            for name in self.prefix_blocks:
                self.prefix_index.remove(self, name)
        self.prefix_blocks, self.prefix_epoch, self.prefix_seq = set(), "", 0

    def apply_prefix_events(self, stats: WorkerStats) -> None:
        """Mirror the group's prefix cache (and the index with it): a snapshot replaces the set,
        events update it in order."""
        index = self.prefix_index
        # no prefix caching there (or the poll did not ask for events), or a snapshot: all anew
        if not stats.prefix_epoch or stats.prefix_snapshot:
            self.forget_prefixes()
        if not stats.prefix_epoch:
            return
        blocks = self.prefix_blocks
        for name, removed in stats.prefix_events:
            if removed:
                blocks.discard(name)
                if index is not None:
                    index.remove(self, name)
            else:
                blocks.add(name)
                if index is not None:
                    index.add(self, name)
        self.prefix_epoch, self.prefix_seq = stats.prefix_epoch, stats.prefix_seq

    def refresh_status(self, now: float, stale_after_s: float = DEFAULT_STALE_AFTER_S) -> GroupStatus:
        status, reason = self._derive_status(now, stale_after_s)
        if status is not self.status:
            log.info("replica group %s (%s): %s -> %s %s", self.replica_group_id or "?", self.address,
                     self.status.name, status.name, reason)
            if status is GroupStatus.DEAD:
                self.forget_prefixes()  # a dead group never serves again: its names leave the index
        self.status, self.status_reason = status, reason
        self.routable = status.routable
        return status

    def _derive_status(self, now: float, stale_after_s: float) -> tuple[GroupStatus, str]:
        if self.failed:
            return GroupStatus.UNHEALTHY, self.failed
        if self.registry_status == "dead":
            return GroupStatus.DEAD, "dead in the registry"
        if self.registry_status == "provisioning":  # loaded, but not yet put in rotation
            return GroupStatus.PROVISIONING, "provisioning in the registry"
        if not self.reported_at:
            return GroupStatus.PROVISIONING, self.stats_error or "no Stats report yet"
        if self.stats_error:
            return GroupStatus.UNHEALTHY, f"Stats failed: {self.stats_error}"
        if now - self.reported_at > stale_after_s:
            return GroupStatus.UNHEALTHY, f"no Stats report for {now - self.reported_at:.1f} s"
        if not self.worker_serving:
            return GroupStatus.UNHEALTHY, "worker health check is NOT_SERVING"
        if self.draining or self.registry_status == "draining":
            return GroupStatus.DRAINING, "draining"
        if self.store_seen:
            if self.store_status is None:
                return GroupStatus.UNHEALTHY, "health store entry expired (heartbeats stopped)"
            if self.store_status in ("unhealthy", "draining"):
                return GroupStatus(self.store_status), f"marked {self.store_status} in the health store"
            if self.store_status == "degraded":
                return GroupStatus.DEGRADED, "a rank is degraded in the health store"
        if self.registry_status == "degraded":
            return GroupStatus.DEGRADED, "degraded in the registry"
        return GroupStatus.HEALTHY, ""


@dataclass(eq=False)
class Reservation:
    """An admitted request's claim on one group's KV cache."""

    reservation_id: int
    request_id: str
    group: ReplicaGroupView
    prompt_tokens: int
    max_tokens: int
    kv_bytes: int
    generated: int = 0  # tokens streamed so far (written by the request's thread)
    materialized_bytes: int = 0  # part of kv_bytes inside the group's last kv_bytes_used
    released: bool = False

    def in_cache_bytes(self) -> int:
        """What the worker holds for this request now, as far as the router can tell."""
        if self.generated == 0:
            return 0  # maybe still queued in the worker: count the whole estimate
        tokens = self.prompt_tokens + self.generated
        return min(self.kv_bytes, tokens * self.group.kv_bytes_per_token)


STATUS_ORDER = ("healthy", "degraded", "draining", "unhealthy")


def worst_status(rank_statuses: dict[str, str]) -> str | None:
    """The worst rank status of a group (unknown values count as unhealthy); None if no ranks."""
    if not rank_statuses:
        return None
    return max(rank_statuses.values(), key=lambda s: STATUS_ORDER.index(s) if s in STATUS_ORDER else 3)


class ReplicaSet:
    """All known groups, one lock and one condition ("something changed": a report arrived or
    a reservation was released) that the admission queue waits on."""

    def __init__(self) -> None:
        self.lock = threading.RLock()  # reentrant: readers may nest (a listing inside a locked section)
        self.changed = threading.Condition(self.lock)
        self._views: dict[str, ReplicaGroupView] = {}
        self.prefix_index = PrefixIndex()

    def add(self, address: str) -> tuple[ReplicaGroupView, bool]:
        """The view of ``address``, created if new (second value True then)."""
        with self.lock:
            view = self._views.get(address)
            if view is not None:
                return view, False
            view = self._views[address] = ReplicaGroupView(address=address, prefix_index=self.prefix_index)
            return view, True

    def known(self, address: str) -> bool:
        return address in self._views

    def views(self) -> list[ReplicaGroupView]:
        """Every view (the caller holds the lock when it reads mutable fields)."""
        return list(self._views.values())

    def for_model(self, model: str) -> list[ReplicaGroupView]:
        return [v for v in self._views.values() if v.model == model]

    def by_group_id(self, replica_group_id: str) -> ReplicaGroupView | None:
        return next((v for v in self._views.values() if v.replica_group_id == replica_group_id), None)

    def mark_full(self, view: ReplicaGroupView) -> None:
        """The worker refused one of our requests as over its KV budget: no headroom there until
        its next report says how much it holds."""
        with self.lock:
            view.kv_bytes_claimed_elsewhere = view.kv_bytes_capacity

    def mark_failed(self, view: ReplicaGroupView, reason: str) -> None:
        with self.lock:
            view.failed = reason
            view.refresh_status(time.monotonic())
            self.changed.notify_all()

    def __iter__(self) -> Iterator[ReplicaGroupView]:
        return iter(self.views())


class GroupPoller:
    """One thread per group: Stats + health check, then the health store, every interval."""

    def __init__(self, replicas: ReplicaSet, view: ReplicaGroupView, source: StatsSource, *,
                 store: HealthStore | None, interval_s: float = DEFAULT_POLL_INTERVAL_S,
                 stale_after_s: float = DEFAULT_STALE_AFTER_S,
                 on_update: Callable[[ReplicaGroupView], None] | None = None, prefix_events: bool = True) -> None:
        self.replicas = replicas
        self.prefix_events = prefix_events  # mirror the group's prefix cache (prefix-aware routing)
        self.view = view
        self.source = source
        self.store = store
        self.interval_s = interval_s
        self.stale_after_s = stale_after_s
        self.on_update = on_update
        self._store_seen_run: str | None = None  # the store server's run at the last read that found the group
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"poll-{view.address}", daemon=True)

    def start(self) -> GroupPoller:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def join(self, timeout_s: float = 5.0) -> None:
        self._thread.join(timeout_s)

    def _run(self) -> None:
        while not self._stop.is_set():
            started = time.monotonic()
            self.poll_once()
            self._stop.wait(max(0.0, self.interval_s - (time.monotonic() - started)))

    def poll_once(self) -> None:
        timeout = max(0.5, self.interval_s * 2)
        stats: WorkerStats | None = None
        error = ""
        serving = True
        try:
            cursor = (self.view.prefix_epoch, self.view.prefix_seq) if self.prefix_events else None
            stats = self.source.stats(timeout, cursor)
            serving = self.source.serving(timeout)
        except StatsLate as exc:  # the last report ages instead; staleness makes it unhealthy
            log.debug("%s", exc)
        except Exception as exc:  # noqa: BLE001 - any failure to report makes the view unhealthy
            error = str(exc) or type(exc).__name__
        store_read = self._read_store(stats)
        with self.replicas.lock:
            view = self.view
            now = time.monotonic()
            if stats is not None:
                view.apply_stats(stats, now=now, wall_ms=time.time_ns() // 1_000_000)
                view.worker_serving = serving
            elif error or not view.reported_at:
                view.stats_error = error or "Stats timed out"
            if store_read is not None:
                seen, status = store_read
                view.store_seen = view.store_seen or seen
                view.store_status = status
            view.refresh_status(now, self.stale_after_s)
            self.replicas.changed.notify_all()
        if self.on_update is not None:
            self.on_update(self.view)

    def _read_store(self, stats: WorkerStats | None) -> tuple[bool, str | None] | None:
        """Mirror KV utilization and read rank health; None when there is nothing to read."""
        if self.store is None or stats is None:
            return None
        gid = stats.replica_group_id
        try:
            if stats.kv_bytes_capacity:
                self.store.set_kv_utilization(gid, min(1.0, stats.kv_bytes_used / stats.kv_bytes_capacity))
            ranks = self.store.group_health(gid)
            run_id = self.store.server_run_id()
            if ranks:
                self._store_seen_run = run_id
            elif self.store.restarted_since(self._store_seen_run):
                # the store restarted empty: until the worker's next heartbeat the group's entry
                # is missing, not expired, and the last status read stands
                return None
        except Exception as exc:  # noqa: BLE001 - a store outage must not stop routing
            log.warning("health store unreachable for %s: %s", gid, exc)
            return None
        return bool(ranks), worst_status(ranks)
