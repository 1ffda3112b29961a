"""Windows and percentiles: exact counts, bounded-error quantiles, sliding retention."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest

from services.common.collective_events import CollectiveEvent
from services.telemetry.sketch import LogHistogram
from services.telemetry.windows import DURATION_BOUNDS_S, WindowConfig, WindowStore

ORIGIN = 1_700_000_000_000


def ev(ts: int, duration_ms: float = 1.0, *, gpu: str = "rg:pp0-tp0", op: str = "all_reduce", nbytes: int = 100,
       timed_out: bool = False, group: str = "rg") -> CollectiveEvent:
    return CollectiveEvent(group, gpu, op, nbytes, duration_ms, 2, ts, timed_out)


def test_quantiles_are_exact_on_bucket_representatives():
    h = LogHistogram()
    values = [h.value_of(i) for i in range(-50, 50)]  # 100 distinct bucket centres, 0.6 µs .. 2.7 ms
    h.extend(reversed(values))
    for q in (0.0, 0.5, 0.95, 0.99, 1.0):
        assert h.quantile(q) == pytest.approx(values[math.floor(q * 99)], rel=1e-12)
    assert h.quantiles((0.99, 0.5, 0.95)) == [h.quantile(0.99), h.quantile(0.5), h.quantile(0.95)]


def test_identical_values_min_and_max_are_exact():
    h = LogHistogram()
    h.extend([0.0371] * 500)
    assert h.quantiles((0.0, 0.5, 0.99, 1.0)) == [0.0371] * 4
    h.add(12.5)
    assert h.quantile(1.0) == 12.5 and h.quantile(0.0) == 0.0371


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_quantiles_within_relative_accuracy_of_the_lower_rank_sample(seed):
    rng = random.Random(seed)
    data = [rng.lognormvariate(-2.0, 1.5) for _ in range(5000)]
    h = LogHistogram(alpha=0.01)
    h.extend(data)
    for q in (0.5, 0.95, 0.99):
        exact = float(np.quantile(data, q, method="lower"))
        assert abs(h.quantile(q) - exact) <= 0.01 * exact * (1 + 1e-9), q
    assert h.count == 5000 and h.sum == pytest.approx(sum(data))


def test_merge_equals_one_histogram_of_both():
    a, b, both = LogHistogram(), LogHistogram(), LogHistogram()
    xs, ys = [0.1 * i for i in range(1, 200)], [3.0 + i for i in range(50)]
    a.extend(xs), b.extend(ys), both.extend(xs + ys)
    a.merge(b)
    assert a.buckets == both.buckets and a.count == both.count
    assert a.quantiles((0.5, 0.99)) == both.quantiles((0.5, 0.99))


def test_events_land_in_the_window_of_their_timestamp():
    store = WindowStore(WindowConfig(window_s=1.0, retain_windows=4), now_ms=ORIGIN)
    events = [ev(ORIGIN + 10 * i, duration_ms=1.0 + i % 7, nbytes=64) for i in range(250)]  # 2.5 windows
    events.append(ev(ORIGIN + 1500, timed_out=True, duration_ms=2000.0))
    assert store.add_many(events) == 251
    (series,) = store.series.values()
    assert {i: w.count for i, w in series.windows.items()} == {0: 100, 1: 101, 2: 50}
    assert series.windows[1].timeouts == 1 and series.windows[1].bytes == 100 * 64 + 100
    assert series.totals.count == 251 and series.totals.timeouts == 1
    assert sum(series.totals.bucket_counts) == 251
    # 2 s lands in the 2.5 s bucket of the exported histogram
    assert series.totals.bucket_counts[DURATION_BOUNDS_S.index(2.5)] == 1


def test_summaries_report_the_current_window_with_percentiles():
    store = WindowStore(WindowConfig(window_s=1.0, retain_windows=4), now_ms=ORIGIN)
    store.add_many(ev(ORIGIN + 1000 + i, duration_ms=float(d)) for i, d in enumerate(range(1, 101)))
    store.add_many([ev(ORIGIN + 5, duration_ms=500.0)])  # an older window: not the current one
    (w,) = store.summaries(now_ms=ORIGIN + 1999)
    assert (w.window_start_ms, w.window_end_ms, w.count, w.bytes, w.timeouts) == (ORIGIN + 1000, ORIGIN + 2000,
                                                                                 100, 10_000, 0)
    # lower-rank samples: index floor(q * 99) of 1..100
    assert w.p50_ms == pytest.approx(50, rel=0.01)
    assert w.p95_ms == pytest.approx(95, rel=0.01)
    assert w.p99_ms == pytest.approx(99, rel=0.01)
    assert store.summaries(op_type="recv") == []


def test_windows_slide_and_late_events_are_counted_not_kept():
    store = WindowStore(WindowConfig(window_s=1.0, retain_windows=3), now_ms=ORIGIN)
    for second in range(6):
        store.add_many([ev(ORIGIN + second * 1000)])
    (series,) = store.series.values()
    assert sorted(series.windows) == [3, 4, 5]
    assert store.add_many([ev(ORIGIN + 1200)]) == 0 and store.late == 1
    assert store.add_many([ev(ORIGIN + 3500)]) == 1  # still retained
    assert series.windows[3].count == 2


def test_series_are_keyed_by_group_gpu_and_op():
    store = WindowStore(WindowConfig(window_s=1.0), now_ms=ORIGIN)
    store.add_many([ev(ORIGIN, gpu=f"rg:pp0-tp{r}", op=op) for r in range(2) for op in ("all_reduce", "broadcast")]
                   + [ev(ORIGIN, group="other", gpu="other:pp0-tp0")])
    assert len(store.series) == 5 and store.groups() == ["other", "rg"]
    assert set(store.stats_at("rg", "all_reduce", 0)) == {"rg:pp0-tp0", "rg:pp0-tp1"}
    assert [w.gpu_id for w in store.summaries(replica_group_id="rg", op_type="broadcast")] == ["rg:pp0-tp0",
                                                                                           "rg:pp0-tp1"]


def test_idle_series_are_forgotten():
    store = WindowStore(WindowConfig(window_s=1.0), now_ms=ORIGIN)
    store.add_many([ev(ORIGIN), ev(ORIGIN + 9000, group="live", gpu="live:pp0-tp0")])
    assert store.forget_idle(ORIGIN + 10_000, idle_windows=5) == ["rg"]
    assert store.groups() == ["live"]
