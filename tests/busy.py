"""Time a process would have taken on an idle machine: for bounds that a busy core must not move.

A test beside other tests on 2 cores sees its processes wait for a CPU; a start-up budget
measured on the wall clock then measures the neighbours. :class:`OwnClock` takes the time a
process's main thread spent runnable but not running (``/proc/PID/schedstat``, its second
field) off the wall clock, leaving the process's own work and its own waits (I/O, sleeps,
answers from others), which is what a budget for that process is about.
"""

from __future__ import annotations

import time
from pathlib import Path


def run_queue_wait_s(pid: int) -> float:
    """Seconds ``pid``'s main thread has waited for a CPU; 0 where the kernel does not say."""
    try:
        return int(Path(f"/proc/{pid}/schedstat").read_text().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return 0.0


class OwnClock:
    """Seconds since this clock was made, for process ``pid``: less the time it waited for a CPU."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.wall0 = time.monotonic()
        self.wait0 = run_queue_wait_s(pid)

    def wall(self) -> float:
        return time.monotonic() - self.wall0

    def seconds(self) -> float:
        return self.wall() - max(0.0, run_queue_wait_s(self.pid) - self.wait0)
