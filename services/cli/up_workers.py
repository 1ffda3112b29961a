"""The replica groups of ``shardline up``: a dead worker process is a failed group, not a dead stack.

A worker process (the group's driver: it runs rank 0 and serves the WorkerService) that exits
fails its replica group, as a dead rank does: the router sees the group's Relay stream break and
continues its requests on the other groups, while this module logs the death with its exit code,
kills what the process group still holds (the ranks), and marks the group ``dead`` in the
registry with the exit code in the reason. A group that failed is never reused (the registry's
lifecycle), so the replacement is a new group: the same plan and port, a new
``--replica-group-id``. Replacing groups is a fleet controller's job; until there is one, each
worker slot is restarted once, after a backoff, and a second death leaves the slot empty.

The router keeps polling the slot's address (``--worker``): the old group's view turns unhealthy
when its Stats stop, and the new group's first Stats report (a new id at that address) replaces it.

:meth:`WorkerSlots.tick` does it all from ``up``'s wait loop, without blocking it for long.
"""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from services.common.healthcheck import check
from services.common.registry import ShardRegistry, registry_group_id
from services.common.supervisor import ManagedProcess, Supervisor

RESTART_BACKOFF_S = 3.0
MAX_RESTARTS = 1


def new_group_name(index: int) -> str:
    """A fresh ``--replica-group-id`` for slot ``index`` (each start gets its own)."""
    return f"rg-{index}-{uuid.uuid4().hex[:6]}"


@dataclass
class WorkerSlot:
    """One worker of the stack: its port, and the group (process) now filling it."""

    index: int
    port: int
    group: str
    managed: ManagedProcess | None
    restarts: int = 0
    restart_at: float | None = None  # monotonic time of a pending restart
    started_at: float = 0.0  # of a restarted process not yet SERVING (0: none)

    @property
    def name(self) -> str:
        return f"worker-{self.index}"


class WorkerSlots:
    """Start the workers, and watch them (``tick``): deaths, registry, one restart each."""

    def __init__(self, supervisor: Supervisor, argv_for: Callable[[int, int, str], list[str]], log_dir: Path,
                 registry_url: str, *, backoff_s: float = RESTART_BACKOFF_S, max_restarts: int = MAX_RESTARTS,
                 say: Callable[[str], None] = lambda line: print(line, flush=True)) -> None:
        self.supervisor = supervisor
        self.argv_for = argv_for  # (index, port, group name) -> the worker's command line
        self.log_dir = log_dir
        self.registry_url = registry_url
        self.backoff_s = backoff_s
        self.max_restarts = max_restarts
        self.say = say
        self.slots: list[WorkerSlot] = []
        self._registry: ShardRegistry | None = None

    def start(self, index: int, port: int) -> ManagedProcess:
        group = new_group_name(index)
        slot = WorkerSlot(index, port, group, None)
        slot.managed = self._spawn(slot, f"worker-{index}.log")
        self.slots.append(slot)
        return slot.managed

    def _spawn(self, slot: WorkerSlot, log_name: str) -> ManagedProcess:
        return self.supervisor.start(slot.name, self.argv_for(slot.index, slot.port, slot.group), slot.port,
                                     log_path=self.log_dir / log_name)

    def tick(self, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        for slot in self.slots:
            managed = slot.managed
            if managed is not None and managed.proc is not None and managed.proc.poll() is not None:
                self._died(slot, managed, now)
            elif slot.restart_at is not None and now >= slot.restart_at:
                self._restart(slot, now)
            elif slot.started_at and managed is not None:
                with contextlib.suppress(Exception):
                    if check(managed.address, timeout_s=0.5) == "SERVING":
                        self.say(f"shardline up: {slot.name} {managed.address:<16} SERVING as replica group "
                                 f"{slot.group} (+{now - slot.started_at:.1f} s after its restart)")
                        slot.started_at = 0.0

    def _died(self, slot: WorkerSlot, managed: ManagedProcess, now: float) -> None:
        code = managed.proc.returncode
        self.supervisor.reap(managed)  # its ranks go too
        slot.managed, slot.started_at = None, 0.0
        marked = self._mark_dead(slot.group, f"worker process exited with code {code}")
        if slot.restarts < self.max_restarts:
            slot.restart_at = now + self.backoff_s
            then = f"restarting it as a new replica group in {self.backoff_s:g} s"
        else:
            then = (f"not restarting it again ({slot.restarts} restart(s) spent; replacing groups is a fleet "
                    f"controller's job)")
        live = sum(1 for s in self.slots if s.managed is not None and s.managed.proc.poll() is None)
        serving = f"{live} other group(s) keep serving" if live else "no replica group is left to serve"
        self.say(f"shardline up: {slot.name} (replica group {slot.group}) exited with code {code}; {marked}; "
                 f"{serving}; {then} (log: {managed.log_path})")

    def _restart(self, slot: WorkerSlot, now: float) -> None:
        slot.restarts += 1
        slot.restart_at = None
        old, slot.group = slot.group, new_group_name(slot.index)
        slot.managed = self._spawn(slot, f"worker-{slot.index}.restart{slot.restarts}.log")
        slot.started_at = now
        self.say(f"shardline up: restarting {slot.name} on {slot.managed.address} as replica group {slot.group} "
                 f"(replaces {old}, same plan)")

    def _mark_dead(self, group: str, reason: str) -> str:
        """Mark the group dead in the registry; what happened, for the log line. A registry
        outage must not stop the stack: the router routes by Stats, not by the registry."""
        try:
            if self._registry is None:
                self._registry = ShardRegistry(self.registry_url)
            gid = registry_group_id(group)
            if self._registry.get_group(gid).status == "dead":
                return "already dead in the registry"  # the driver saw its group fail first
            self._registry.set_status(gid, "dead", reason=reason)
            return "marked dead in the registry"
        except Exception as exc:  # noqa: BLE001 - an outage (SQLAlchemy's errors) as much as a RegistryError
            return f"not marked dead in the registry ({exc})"

    def close(self) -> None:
        if self._registry is not None:
            self._registry.close()
            self._registry = None
