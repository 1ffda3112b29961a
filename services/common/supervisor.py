"""Run a set of local service processes as one unit: start, wait healthy, stop all, no orphans.

Used by ``shardline up``. Each child gets its own process group, so stopping the stack also
stops whatever a child spawned (a worker's rank processes). Stop sends SIGTERM, waits, then
SIGKILLs what is left.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field

from services.common.healthcheck import check


@dataclass
class ManagedProcess:
    name: str
    argv: list[str]
    port: int
    proc: subprocess.Popen | None = None
    env: dict[str, str] = field(default_factory=dict)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"


class StackError(RuntimeError):
    """A service of the local stack failed to start or died."""


class Supervisor:
    def __init__(self) -> None:
        self.processes: list[ManagedProcess] = []

    def start(self, name: str, argv: list[str], port: int, *, env: dict[str, str] | None = None) -> ManagedProcess:
        managed = ManagedProcess(name, argv, port, env=env or {})
        managed.proc = subprocess.Popen(argv, env={**os.environ, **managed.env}, start_new_session=True)
        self.processes.append(managed)
        return managed

    def wait_healthy(self, managed: ManagedProcess, timeout_s: float) -> float:
        """Seconds until the process's gRPC health check says SERVING."""
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout_s:
            assert managed.proc is not None
            if managed.proc.poll() is not None:
                raise StackError(f"{managed.name} exited with code {managed.proc.returncode} while starting")
            with contextlib.suppress(Exception):
                if check(managed.address, timeout_s=1.0) == "SERVING":
                    return time.monotonic() - t0
            time.sleep(0.2)
        raise StackError(f"{managed.name} on {managed.address} not SERVING within {timeout_s:g} s")

    def dead(self) -> list[ManagedProcess]:
        return [m for m in self.processes if m.proc is not None and m.proc.poll() is not None]

    def stop_all(self, grace_s: float = 15.0) -> None:
        live = [m for m in reversed(self.processes) if m.proc is not None and m.proc.poll() is None]
        for managed in live:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(managed.proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for managed in live:
            try:
                managed.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                print(f"{managed.name} did not stop within {grace_s:g} s: killing", file=sys.stderr)
        for managed in self.processes:
            # the group may still hold children of a process that exited (its ranks)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(managed.proc.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                managed.proc.wait(timeout=5)
