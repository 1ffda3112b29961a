"""Which of several fleet controllers acts: the holder of the registry's ``fleet-controller`` lease.

Every controller calls :meth:`LeaderElection.step` once per reconcile. The holder renews the
lease; the others watch it, and take it over (the next term) once they have seen it unchanged for
its TTL on their own clocks. A holder that has not renewed for ``ttl_s * RENEW_DEADLINE`` stops
acting before anyone may take over; one that was paused longer (SIGSTOP, a frozen VM) and wakes
up still believing it leads is refused by the fence: its registry checks the term in every
transaction (``registry.leases``), so it cannot write, and its next step finds it deposed.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Callable

from services.common.registry import Lease, ShardRegistry

log = logging.getLogger(__name__)

LEASE = "fleet-controller"
DEFAULT_TTL_S = 10.0
# the holder counts itself deposed once this share of the TTL passed without a renewal, so that it
# stops before an observer, timing the full TTL on its own clock, may take over
RENEW_DEADLINE = 2 / 3


def holder_id() -> str:
    """This process, as the lease names it: host and pid."""
    return f"{socket.gethostname()}:{os.getpid()}"


def _gone(holder: str) -> bool:
    """Whether ``holder`` was a process of this host that no longer runs (a controller that was
    killed here: its successor need not wait out the TTL)."""
    host, _, pid = holder.rpartition(":")
    if host != socket.gethostname() or not pid.isdigit() or int(pid) == os.getpid():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # alive, someone else's
        return False
    return False


class LeaderElection:
    def __init__(self, registry: ShardRegistry, *, holder: str | None = None, ttl_s: float = DEFAULT_TTL_S,
                 name: str = LEASE, clock: Callable[[], float] = time.monotonic) -> None:
        self.registry = registry
        self.holder = holder or holder_id()
        self.ttl_s = ttl_s
        self.name = name
        self.clock = clock
        self.lease: Lease | None = None  # held, as last renewed
        self.renewed_at = 0.0
        self._seen: tuple[str, int, int] | None = None  # the lease as last read, and since when
        self._seen_at = 0.0

    @property
    def term(self) -> int | None:
        return self.lease.term if self.lease is not None else None

    def step(self) -> bool:
        """Renew, watch or take over; whether this process leads now. A registry error is no
        verdict: a holder keeps leading until its renew deadline, an observer keeps watching."""
        now = self.clock()
        try:
            if self.lease is not None:
                renewed = self.registry.renew_lease(self.lease)
                if renewed is None:
                    self._deposed("another holder has the lease")
                else:
                    self.lease, self.renewed_at = renewed, now
            else:
                self._watch_or_take(now)
        except Exception as exc:  # noqa: BLE001 - a registry outage: judged by the deadline below
            log.warning("lease %s: %s", self.name, exc)
        if self.lease is not None and now - self.renewed_at > self.ttl_s * RENEW_DEADLINE:
            self._deposed(f"no renewal for {now - self.renewed_at:.1f} s")
        return self.lease is not None

    def _watch_or_take(self, now: float) -> None:
        lease = self.registry.read_lease(self.name)
        if lease is not None and lease.holder and not _gone(lease.holder):
            if lease.seen != self._seen:
                self._seen, self._seen_at = lease.seen, now
                return
            if now - self._seen_at < lease.ttl_s:
                return
        taken = self.registry.take_lease(self.name, self.holder, self.ttl_s, seen=lease)
        if taken is not None:
            before = f"from {lease.holder} (term {lease.term})" if lease is not None and lease.holder else "(free)"
            log.warning("lease %s: taken %s, term %d", self.name, before, taken.term)
            self.lease, self.renewed_at = taken, now

    def _deposed(self, why: str) -> None:
        log.warning("lease %s: term %s is over for %s: %s", self.name, self.term, self.holder, why)
        self.lease = None
        self._seen = None

    def release(self) -> None:
        """Give the lease up at a clean stop, so that a standby takes over at once."""
        if self.lease is not None:
            try:
                self.registry.release_lease(self.lease)
            except Exception as exc:  # noqa: BLE001 - it expires all the same
                log.warning("lease %s: not released: %s", self.name, exc)
            self.lease = None
