"""What a replica group's prefix cache holds, as an event stream the routers mirror.

The engine's loop thread tells the log of each block registered under a name and each cached
block evicted; a router's Stats poll (another thread) reads the events after its cursor. The log
keeps the last ``capacity`` events and the set of names cached now: a reader whose cursor is from
another epoch (the worker restarted) or older than the oldest event kept gets the whole set
instead (a snapshot), and goes on from its sequence number. Pull-based, with a cursor per reader,
so any number of routers mirror one group and one that was down catches up.
"""

from __future__ import annotations

import threading
import uuid
from collections import deque
from dataclasses import dataclass, field

DEFAULT_CAPACITY = 65_536
MAX_EVENTS_PER_READ = 100_000  # a reply stays far below gRPC's 4 MiB (~20 bytes per event)


@dataclass
class PrefixEvents:
    """One read: events (name, removed) in order, or with ``snapshot`` every cached name."""

    epoch: str
    seq: int  # the reader's cursor from now on
    snapshot: bool
    events: list[tuple[bytes, bool]] = field(default_factory=list)


class PrefixCacheLog:
    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        self.epoch = uuid.uuid4().hex[:16]
        self._lock = threading.Lock()
        self._events: deque[tuple[bytes, bool]] = deque(maxlen=capacity)
        self._seq = 0  # events ever logged; the next one is number _seq
        self._cached: set[bytes] = set()

    def stored(self, name: bytes) -> None:
        with self._lock:
            self._cached.add(name)
            self._events.append((name, False))
            self._seq += 1

    def removed(self, name: bytes) -> None:
        with self._lock:
            self._cached.discard(name)
            self._events.append((name, True))
            self._seq += 1

    def read(self, epoch: str, after: int) -> PrefixEvents:
        """The events after ``after`` of ``epoch``, else a snapshot (see the module docstring)."""
        with self._lock:
            oldest = self._seq - len(self._events)
            if epoch != self.epoch or not oldest <= after <= self._seq:
                names = list(self._cached)[:MAX_EVENTS_PER_READ]
                return PrefixEvents(self.epoch, self._seq, True, [(name, False) for name in names])
            count = min(self._seq - after, MAX_EVENTS_PER_READ)
            start = len(self._events) - (self._seq - after)
            events = [self._events[i] for i in range(start, start + count)]
            return PrefixEvents(self.epoch, after + count, False, events)
