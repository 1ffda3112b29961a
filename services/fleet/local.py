"""The local provisioner: each replica group is one ``shardline serve worker`` process group.

The worker (the group's driver) spawns its TP x PP ranks itself, so stopping its process group
stops the whole replica group. Every group gets a port no earlier group of this provisioner
used: a router that still polls a dead group's address must never find the new group there
before the registry says what it is. Children die with this process (``Supervisor``).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from services.common.ports import bindable, free_port
from services.common.supervisor import ManagedProcess, Supervisor
from services.fleet.provisioner import GroupLaunch, GroupProcess

STOP_GRACE_S = 15.0  # SIGTERM, then SIGKILL: a driver that drains and deregisters takes a few seconds


def last_words(managed: ManagedProcess, limit: int = 300) -> str:
    """``: <the last line of its log>`` (what a worker that failed to load says last), or ''."""
    lines = [line.strip() for line in managed.log_tail(5).splitlines() if line.strip()]
    return f": {lines[-1][:limit]}" if lines else ""


@dataclass
class _Started:
    launch: GroupLaunch
    managed: ManagedProcess
    stopping: bool = False


class LocalProvisioner:
    def __init__(self, supervisor: Supervisor, shared_flags: list[str], log_dir: Path, *,
                 port_of: Callable[[], int] = free_port, stop_grace_s: float = STOP_GRACE_S) -> None:
        self.supervisor = supervisor
        self.shared_flags = list(shared_flags)  # registry, health store, telemetry: the same for every group
        self.log_dir = log_dir
        self.port_of = port_of
        self.stop_grace_s = stop_grace_s
        self._started: dict[str, _Started] = {}
        self._used_ports: set[int] = set()
        self._lock = threading.Lock()

    def _fresh_port(self) -> int:
        for _ in range(100):
            port = self.port_of()
            if port not in self._used_ports and bindable(port):
                self._used_ports.add(port)
                return port
        raise OSError("no fresh port for a replica group")

    def start(self, launch: GroupLaunch) -> None:
        port = self._fresh_port()
        argv = [sys.executable, "-m", "services.cli", "serve", "worker", "--port", str(port),
                *launch.worker_flags(), *self.shared_flags]
        managed = self.supervisor.start(launch.name, argv, port, env=dict(launch.plan.env),
                                        log_path=self.log_dir / f"{launch.name}.log")
        with self._lock:
            self._started[launch.name] = _Started(launch, managed)

    def stop(self, name: str) -> None:
        with self._lock:
            started = self._started.pop(name, None)
        if started is None:
            return
        proc = started.managed.proc
        assert proc is not None
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGTERM)
        threading.Thread(target=self._reap, args=(started.managed,), name=f"stop-{name}", daemon=True).start()

    def _reap(self, managed: ManagedProcess) -> None:
        assert managed.proc is not None
        with contextlib.suppress(subprocess.TimeoutExpired):
            managed.proc.wait(timeout=self.stop_grace_s)
        self.supervisor.reap(managed)  # SIGKILLs what the process group still holds

    def groups(self) -> list[GroupProcess]:
        with self._lock:
            started = list(self._started.values())
        out = []
        for s in started:
            code = s.managed.proc.poll() if s.managed.proc is not None else -1
            # a worker that exits on its own says why last; one killed by a signal said nothing
            words = last_words(s.managed) if code is not None and code > 0 else ""
            reason = "" if code is None else f"worker process exited with code {code}{words}"
            out.append(GroupProcess(s.launch.name, code is None, reason, s.managed.address))
        return out

    def log_path(self, name: str) -> Path:
        return self.log_dir / f"{name}.log"

    def close(self) -> None:
        with self._lock:
            names = list(self._started)
        for name in names:
            self.stop(name)
