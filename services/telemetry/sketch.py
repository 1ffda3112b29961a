"""A log-bucketed histogram of durations: percentiles with a bounded relative error.

Buckets are fixed and log-spaced, as in DDSketch: with ``gamma = (1 + alpha) / (1 - alpha)``,
bucket ``i`` holds the values ``v`` with ``gamma**(i-1) < v <= gamma**i``, and is reported as
``2 * gamma**i / (gamma + 1)``, which is within ``alpha`` (relative) of every value in it. So a
percentile read from the histogram is within ``alpha`` of the sample it stands for, whatever
the distribution, and nothing is ever sorted: adding a value is one ``log`` and one array
increment. Only the range of buckets between the lowest and highest value is stored, so a window
whose durations sit within a factor of 10 keeps ~115 four-byte counters at the default 1 %.

Quantiles use the "lower" rank convention: ``quantile(q)`` stands for the sorted sample at index
``floor(q * (n - 1))`` and is clamped to ``[min, max]``; the minimum and maximum are tracked
exactly, so rank 0, rank n - 1 and a histogram of identical values are exact.
"""

from __future__ import annotations

import math
from array import array
from collections.abc import Iterable

DEFAULT_RELATIVE_ACCURACY = 0.01
# Values at or below this (ms) share one bucket: a collective never completes in under 1 ns.
MIN_TRACKED_MS = 1e-6


class LogHistogram:
    """Counts of durations (ms) in log-spaced buckets; see the module docstring for the math.

    Counts live in one dense ``array('I')`` covering the buckets from the lowest to the highest
    seen (4 bytes a bucket: ~1 KB for a window whose durations span a factor of 10), grown at
    either end when a value falls outside.
    """

    __slots__ = ("alpha", "gamma", "_inv_log_gamma", "base", "counts", "count", "min", "max", "sum")

    def __init__(self, alpha: float = DEFAULT_RELATIVE_ACCURACY) -> None:
        if not 0.0 < alpha < 1.0:
            raise ValueError(f"relative accuracy must be in (0, 1), got {alpha}")
        self.alpha = alpha
        self.gamma = (1.0 + alpha) / (1.0 - alpha)
        self._inv_log_gamma = 1.0 / math.log(self.gamma)
        self.base = 0  # bucket index of counts[0]
        self.counts = array("I")
        self.count = 0
        self.min = math.inf
        self.max = -math.inf
        self.sum = 0.0

    def index_of(self, value_ms: float) -> int:
        if value_ms <= MIN_TRACKED_MS:
            value_ms = MIN_TRACKED_MS
        return math.ceil(math.log(value_ms) * self._inv_log_gamma)

    def value_of(self, index: int) -> float:
        """The bucket's representative: within ``alpha`` of every value the bucket holds."""
        return 2.0 * self.gamma ** index / (self.gamma + 1.0)

    @property
    def buckets(self) -> dict[int, int]:
        """``{bucket index: count}`` of the non-empty buckets."""
        return {self.base + k: n for k, n in enumerate(self.counts) if n}

    def _cover(self, index: int) -> None:
        counts = self.counts
        if not counts:
            self.base = index
            counts.append(0)
        elif index < self.base:
            counts[0:0] = array("I", bytes(4 * (self.base - index)))
            self.base = index
        elif index >= self.base + len(counts):
            counts.extend(array("I", bytes(4 * (index - self.base - len(counts) + 1))))

    def add(self, value_ms: float) -> None:
        v = value_ms if value_ms > MIN_TRACKED_MS else MIN_TRACKED_MS
        index = math.ceil(math.log(v) * self._inv_log_gamma)
        off = index - self.base
        counts = self.counts
        if off < 0 or off >= len(counts):
            self._cover(index)  # grows ``counts`` in place
            off = index - self.base
        counts[off] += 1
        self.count += 1
        self.sum += value_ms
        if value_ms < self.min:
            self.min = value_ms
        if value_ms > self.max:
            self.max = value_ms

    def extend(self, values: Iterable[float]) -> None:
        for v in values:
            self.add(v)

    def merge(self, other: LogHistogram) -> None:
        if other.gamma != self.gamma:
            raise ValueError(f"cannot merge histograms of accuracy {other.alpha} into {self.alpha}")
        if not other.counts:
            return
        self._cover(other.base)
        self._cover(other.base + len(other.counts) - 1)
        shift = other.base - self.base
        counts = self.counts
        for k, n in enumerate(other.counts):
            if n:
                counts[shift + k] += n
        self.count += other.count
        self.sum += other.sum
        self.min = min(self.min, other.min)
        self.max = max(self.max, other.max)

    def quantile(self, q: float) -> float:
        """The q-quantile (0 <= q <= 1) in ms; 0.0 for an empty histogram."""
        return self.quantiles((q,))[0]

    def quantiles(self, qs: Iterable[float]) -> list[float]:
        """Several quantiles in one pass over the buckets."""
        wanted = sorted((q, k) for k, q in enumerate(qs))
        out = [0.0] * len(wanted)
        for q, _ in wanted:
            if not 0.0 <= q <= 1.0:
                raise ValueError(f"quantile must be in [0, 1], got {q}")
        if self.count == 0:
            return out
        counts = self.counts
        seen, j = 0, 0
        for q, k in wanted:
            rank = math.floor(q * (self.count - 1))
            while seen <= rank:
                seen += counts[j]
                j += 1
            if rank == 0:
                out[k] = self.min
            elif rank == self.count - 1:
                out[k] = self.max
            else:
                out[k] = min(max(self.value_of(self.base + j - 1), self.min), self.max)
        return out

    def __len__(self) -> int:
        return self.count
