"""Sliding windows of collective telemetry per (replica_group_id, gpu_id, op_type).

Time is cut into windows of ``window_s`` seconds counted from ``origin_ms`` (the service's start
unless given), and an event lands in the window of its own ``timestamp_ms`` (the rank's clock),
so batching and shipping delays do not smear it into a later window. Each series keeps its last
``retain_windows`` windows; the set slides forward as time does, and older windows are dropped.
A window holds the event count, payload bytes, timeouts and a :class:`LogHistogram` of durations
(p50/p95/p99 within the histogram's relative accuracy, never by sorting the events).

Each series also keeps cumulative totals since it was first seen (count, bytes, timeouts, sum of
durations and counts on fixed bucket bounds): the exporters turn those into the
``shardline.collective.*`` metrics, so the hot path touches each event once.

The store is not thread-safe; :class:`services.telemetry.pipeline.TelemetryPipeline` holds a
lock around it. Events are read by attribute (``replica_group_id``, ``gpu_id``, ``op_type``,
``bytes``, ``duration_ms``, ``group_size``, ``timestamp_ms``, ``timed_out``): a
:class:`~services.common.collective_events.CollectiveEvent` or anything shaped like one.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

from services.telemetry.sketch import DEFAULT_RELATIVE_ACCURACY, LogHistogram

# Upper bounds (seconds) of the exported duration histogram: decode all-reduces on NVLink sit at
# tens of µs, a 2 s timeout at the top. Prometheus adds +Inf.
DURATION_BOUNDS_S: tuple[float, ...] = (
    0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
    1.0, 2.5, 5.0, 10.0)
_DURATION_BOUNDS_MS: tuple[float, ...] = tuple(b * 1e3 for b in DURATION_BOUNDS_S)


class EventLike(Protocol):
    replica_group_id: str
    gpu_id: str
    op_type: str
    bytes: int
    duration_ms: float
    group_size: int
    timestamp_ms: int
    timed_out: bool
    peer_lost: bool
    seq: int
    communicator: str


@dataclass(frozen=True)
class WindowConfig:
    """How long a window is and how many each series keeps."""

    window_s: float = 10.0
    retain_windows: int = 6
    relative_accuracy: float = DEFAULT_RELATIVE_ACCURACY
    origin_ms: int | None = None  # None: the store's creation time

    def __post_init__(self) -> None:
        if not self.window_s > 0:
            raise ValueError(f"window_s must be > 0, got {self.window_s}")
        if self.retain_windows < 2:
            raise ValueError(f"retain_windows must be >= 2 (the current one and a closed one), "
                             f"got {self.retain_windows}")

    @property
    def window_ms(self) -> int:
        return max(1, round(self.window_s * 1e3))


class WindowStats:
    """One series over one window."""

    __slots__ = ("index", "count", "bytes", "timeouts", "durations")

    def __init__(self, index: int, alpha: float) -> None:
        self.index = index
        self.count = 0
        self.bytes = 0
        self.timeouts = 0
        self.durations = LogHistogram(alpha)


class SeriesTotals:
    """Cumulative totals of one series since it was first seen (the exporters' source)."""

    __slots__ = ("count", "bytes", "timeouts", "sum_ms", "bucket_counts", "min_ms", "max_ms")

    def __init__(self) -> None:
        self.count = 0
        self.bytes = 0
        self.timeouts = 0
        self.sum_ms = 0.0
        self.bucket_counts = [0] * (len(DURATION_BOUNDS_S) + 1)
        self.min_ms = float("inf")
        self.max_ms = 0.0

    def copy(self) -> SeriesTotals:
        c = SeriesTotals()
        c.count, c.bytes, c.timeouts, c.sum_ms = self.count, self.bytes, self.timeouts, self.sum_ms
        c.bucket_counts = list(self.bucket_counts)
        c.min_ms, c.max_ms = self.min_ms, self.max_ms
        return c


class Series:
    """The retained windows and the totals of one (replica_group_id, gpu_id, op_type)."""

    __slots__ = ("replica_group_id", "gpu_id", "op_type", "group_size", "windows", "current",
                 "totals", "last_seen_ms", "communicator", "last_seq")

    def __init__(self, replica_group_id: str, gpu_id: str, op_type: str, group_size: int,
                 communicator: str = "") -> None:
        self.replica_group_id = replica_group_id
        self.gpu_id = gpu_id
        self.op_type = op_type
        self.group_size = group_size
        self.windows: dict[int, WindowStats] = {}
        self.current: WindowStats | None = None
        self.totals = SeriesTotals()
        self.last_seen_ms = 0
        self.communicator = communicator  # where this op type runs for this rank ("" for point-to-point)
        self.last_seq = 0  # the highest op number the rank reported on it, late events included


@dataclass(frozen=True)
class WindowSummary:
    """What Query returns for one series: its aggregates over one window."""

    replica_group_id: str
    gpu_id: str
    op_type: str
    window_start_ms: int
    window_end_ms: int
    count: int
    bytes: int
    p50_ms: float
    p95_ms: float
    p99_ms: float
    timeouts: int


class WindowStore:
    """Per-series sliding windows; ``add_many`` is the ingest hot path."""

    def __init__(self, config: WindowConfig | None = None, *, now_ms: int | None = None) -> None:
        self.config = config or WindowConfig()
        self.window_ms = self.config.window_ms
        self.origin_ms = (self.config.origin_ms if self.config.origin_ms is not None
                          else (now_ms if now_ms is not None else int(time.time() * 1e3)))
        self.retain = self.config.retain_windows
        self.alpha = self.config.relative_accuracy
        self.series: dict[tuple[str, str, str], Series] = {}
        self._by_group: dict[str, list[Series]] = {}
        self.accepted = 0
        self.late = 0  # events older than every retained window of their series

    # -- time --------------------------------------------------------------------------------
    def window_index(self, timestamp_ms: int) -> int:
        return (timestamp_ms - self.origin_ms) // self.window_ms

    def bounds(self, index: int) -> tuple[int, int]:
        start = self.origin_ms + index * self.window_ms
        return start, start + self.window_ms

    # -- ingest ------------------------------------------------------------------------------
    def add_many(self, events: Iterable[EventLike], timed_out: list | None = None) -> int:
        """Add events; returns how many were accepted (late ones are counted in ``late``).
        Events with ``timed_out`` set are also appended to ``timed_out`` (late ones included)."""
        series_map = self.series
        origin, wms = self.origin_ms, self.window_ms
        bounds_ms = _DURATION_BOUNDS_MS
        bisect_left = bisect.bisect_left
        accepted = 0
        for e in events:
            key = (e.replica_group_id, e.gpu_id, e.op_type)
            s = series_map.get(key)
            if s is None:
                s = self._new_series(key, e.group_size, e.communicator)
            if e.seq > s.last_seq:
                s.last_seq = e.seq
            ts = e.timestamp_ms
            w = s.current
            idx = (ts - origin) // wms
            if w is None or w.index != idx:
                w = self._window(s, idx)
                if w is None:
                    self.late += 1
                    if e.timed_out and timed_out is not None:
                        timed_out.append(e)
                    continue
            duration = e.duration_ms
            nbytes = e.bytes
            w.count += 1
            w.bytes += nbytes
            w.durations.add(duration)
            t = s.totals
            t.count += 1
            t.bytes += nbytes
            t.sum_ms += duration
            t.bucket_counts[bisect_left(bounds_ms, duration)] += 1
            if duration < t.min_ms:
                t.min_ms = duration
            if duration > t.max_ms:
                t.max_ms = duration
            if e.timed_out:
                w.timeouts += 1
                t.timeouts += 1
                if timed_out is not None:
                    timed_out.append(e)
            if ts > s.last_seen_ms:
                s.last_seen_ms = ts
            accepted += 1
        self.accepted += accepted
        return accepted

    def _new_series(self, key: tuple[str, str, str], group_size: int, communicator: str) -> Series:
        s = Series(*key, group_size, communicator)
        self.series[key] = s
        self._by_group.setdefault(key[0], []).append(s)
        return s

    def _window(self, s: Series, idx: int) -> WindowStats | None:
        w = s.windows.get(idx)
        if w is not None:
            if s.current is None or idx > s.current.index:
                s.current = w
            return w
        newest = s.current.index if s.current is not None else idx
        if idx <= newest - self.retain:
            return None  # older than anything this series still keeps
        w = WindowStats(idx, self.alpha)
        s.windows[idx] = w
        if idx >= newest:
            s.current = w
            for old in [i for i in s.windows if i <= idx - self.retain]:
                del s.windows[old]
        return w

    # -- reads -------------------------------------------------------------------------------
    def groups(self) -> list[str]:
        return sorted(self._by_group)

    def series_of(self, replica_group_id: str) -> list[Series]:
        return list(self._by_group.get(replica_group_id, ()))

    def stats_at(self, replica_group_id: str, op_type: str, index: int) -> dict[str, WindowStats]:
        """``{gpu_id: stats}`` of one group's ``op_type`` series in window ``index``."""
        return {s.gpu_id: s.windows[index] for s in self._by_group.get(replica_group_id, ())
                if s.op_type == op_type and index in s.windows}

    def summaries(self, *, replica_group_id: str = "", gpu_id: str = "", op_type: str = "",
                  now_ms: int | None = None) -> list[WindowSummary]:
        """Each matching series over its current window: the one holding ``now_ms``, or, for a
        series with no event in it yet, its latest retained window. Sorted by key."""
        now_idx = self.window_index(now_ms if now_ms is not None else int(time.time() * 1e3))
        out = []
        for key in sorted(self.series):
            s = self.series[key]
            if ((replica_group_id and s.replica_group_id != replica_group_id)
                    or (gpu_id and s.gpu_id != gpu_id) or (op_type and s.op_type != op_type)):
                continue
            candidates = [i for i in s.windows if i <= now_idx] or list(s.windows)
            if not candidates:
                continue
            w = s.windows[max(candidates)]
            start, end = self.bounds(w.index)
            p50, p95, p99 = w.durations.quantiles((0.5, 0.95, 0.99))
            out.append(WindowSummary(s.replica_group_id, s.gpu_id, s.op_type, start, end, w.count, w.bytes,
                                     p50, p95, p99, w.timeouts))
        return out

    def forget_idle(self, now_ms: int, idle_windows: int) -> list[str]:
        """Drop series silent for ``idle_windows`` windows (a replaced group's ranks); returns the
        groups that no longer have any series."""
        cutoff = now_ms - idle_windows * self.window_ms
        emptied = []
        for key in [k for k, s in self.series.items() if s.last_seen_ms < cutoff]:
            s = self.series.pop(key)
            members = self._by_group[s.replica_group_id]
            members.remove(s)
            if not members:
                del self._by_group[s.replica_group_id]
                emptied.append(s.replica_group_id)
        return emptied
