"""How long a group has been silent, as the fleet controller itself has watched it.

A worker writes its shards' ``last_heartbeat`` every second. Comparing that timestamp with the
controller's wall clock would judge a group by two hosts' clocks, and by time in which the
controller was not looking: a controller whose process (or whose registry) stalled for 20 s
would come back, read 20 s old heartbeats that the workers could not write either, and kill
groups that served throughout. So a group's silence is measured on the controller's own clock,
from the first reading that showed its current heartbeat (the way a Kubernetes node controller
watches node leases), and a gap between two readings longer than the timeout starts every
group's measure again: silence nobody observed is not evidence.
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime


class HeartbeatWatch:
    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._seen: dict[str, tuple[datetime, float]] = {}  # group -> (latest heartbeat, when first read)
        self._last_reading: float | None = None

    def reading(self, now: float) -> None:
        """The controller read the registry at ``now``: after a longer gap, start watching afresh."""
        if self._last_reading is not None and now - self._last_reading > self.timeout_s:
            self._seen.clear()
        self._last_reading = now

    def silent_for(self, group: str, latest: datetime, now: float) -> float:
        """Seconds since ``group``'s heartbeat last changed, as far as the readings show (0 when
        it changed since the previous reading or is seen for the first time)."""
        seen = self._seen.get(group)
        if seen is None or seen[0] != latest:
            self._seen[group] = (latest, now)
            return 0.0
        return now - seen[1]

    def keep_only(self, groups: Iterable[str]) -> None:
        """Forget the groups not listed (dead or gone)."""
        keep = set(groups)
        for name in [n for n in self._seen if n not in keep]:
            del self._seen[name]
