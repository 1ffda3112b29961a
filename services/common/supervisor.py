"""Run a set of local service processes as one unit: start, wait healthy, stop all, no orphans.

Used by ``shardline up``. Each child gets its own process group, so stopping the stack also
stops whatever a child spawned (a worker's rank processes), and on Linux each child is told to
receive SIGTERM if the supervising process dies (``PR_SET_PDEATHSIG``), so even a killed
``shardline up`` leaves nothing behind. Stop sends SIGTERM to every group, waits, then
SIGKILLs what is left. A child's output goes to its own log file when one is given; a child
that fails to start is reported with the tail of that log.

A process may be forked from a :class:`~services.common.fork_server.ForkServer` that has imported
its module already, instead of starting a fresh interpreter: the same process, started without
paying for its imports again (where the server cannot serve the request, a fresh one it is).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from services.common.fork_server import ForkedProcess, ForkServer, kill_group
from services.common.fork_server import die_with_parent as set_parent_death_signal
from services.common.healthcheck import check

LOG_TAIL_LINES = 30


@dataclass
class ManagedProcess:
    name: str
    argv: list[str]
    port: int
    proc: subprocess.Popen | ForkedProcess | None = None
    env: dict[str, str] = field(default_factory=dict)
    log_path: Path | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def log_tail(self, lines: int = LOG_TAIL_LINES) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        text = self.log_path.read_text(errors="replace").splitlines()[-lines:]
        return "\n".join(f"    {line}" for line in text)


class StackError(RuntimeError):
    """A service of the local stack failed to start or died."""


class StackStopped(StackError):
    """Stopping was requested (Ctrl-C, SIGTERM) while waiting."""


class Supervisor:
    def __init__(self, stop: threading.Event | None = None) -> None:
        self.processes: list[ManagedProcess] = []
        self.stop_requested = stop or threading.Event()

    def start(self, name: str, argv: list[str], port: int, *, env: dict[str, str] | None = None,
              log_path: Path | None = None, die_with_parent: bool = True, track: bool = True,
              fork_server: ForkServer | None = None) -> ManagedProcess:
        """``die_with_parent`` False and ``track`` False: a process that outlives this one and
        that :meth:`stop_all` leaves alone (a fleet's kept replica group). ``fork_server``: fork
        it from there when the server fits the command."""
        managed = ManagedProcess(name, argv, port, env=env or {}, log_path=log_path)
        environ = {**os.environ, **managed.env}
        if fork_server is not None and fork_server.fits(argv, environ, log_path):
            assert log_path is not None
            log_path.parent.mkdir(parents=True, exist_ok=True)
            try:
                managed.proc = fork_server.spawn(argv, environ, log_path, die_with_parent=die_with_parent)
            except OSError as exc:
                print(f"{name}: {exc}; starting a fresh process", file=sys.stderr)
        if managed.proc is None:
            self._popen(managed, die_with_parent)
        if track:
            self.processes.append(managed)
        return managed

    @staticmethod
    def _popen(managed: ManagedProcess, die_with_parent: bool) -> None:
        log_path = managed.log_path
        out = None  # no log file: the child shares our terminal
        if log_path is not None:
            log_path.parent.mkdir(parents=True, exist_ok=True)
            out = log_path.open("wb")
        try:
            managed.proc = subprocess.Popen(
                managed.argv, env={**os.environ, **managed.env}, start_new_session=True, stdin=subprocess.DEVNULL,
                stdout=out, stderr=subprocess.STDOUT if out is not None else None,
                preexec_fn=set_parent_death_signal if die_with_parent and sys.platform.startswith("linux") else None)
        finally:
            if out is not None:
                out.close()  # the child holds its own descriptor

    def failure(self, managed: ManagedProcess, what: str) -> StackError:
        tail = managed.log_tail()
        where = f" (log: {managed.log_path})" if managed.log_path else ""
        return StackError(f"{managed.name} {what}{where}" + (f"\n{tail}" if tail else ""))

    def wait_healthy(self, managed: ManagedProcess, timeout_s: float) -> float:
        """Seconds until the process's gRPC health check says SERVING."""
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout_s:
            if self.stop_requested.is_set():
                raise StackStopped("stopped while starting")
            assert managed.proc is not None
            if managed.proc.poll() is not None:
                raise self.failure(managed, f"exited with code {managed.proc.returncode} while starting")
            with contextlib.suppress(Exception):
                if check(managed.address, timeout_s=1.0) == "SERVING":
                    return time.monotonic() - t0
            self.stop_requested.wait(0.2)
        raise self.failure(managed, f"on {managed.address} not SERVING within {timeout_s:g} s")

    def dead(self) -> list[ManagedProcess]:
        return [m for m in self.processes if m.proc is not None and m.proc.poll() is not None]

    def reap(self, managed: ManagedProcess) -> None:
        """Forget a process that exited, first killing what its process group still holds (a
        driver's ranks outlive a SIGKILLed driver); a replacement is a new :meth:`start`."""
        if managed.proc is not None:
            kill_group(managed.proc.pid, leader_alive=managed.proc.poll() is None)
            with contextlib.suppress(subprocess.TimeoutExpired):
                managed.proc.wait(timeout=5)
        if managed in self.processes:
            self.processes.remove(managed)

    def stop_all(self, grace_s: float = 15.0) -> None:
        live = [m for m in reversed(self.processes) if m.proc is not None and m.proc.poll() is None]
        for managed in live:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(managed.proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for managed in live:
            try:
                managed.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                print(f"{managed.name} did not stop within {grace_s:g} s: killing", file=sys.stderr)
        for managed in self.processes:
            # the group may still hold children of a process that exited (its ranks)
            kill_group(managed.proc.pid, leader_alive=managed.proc.poll() is None)
            with contextlib.suppress(subprocess.TimeoutExpired):
                managed.proc.wait(timeout=5)
