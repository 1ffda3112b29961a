"""The local provisioner: each replica group is one ``shardline serve worker`` process group.

The worker (the group's driver) spawns its TP x PP ranks itself, so stopping its process group
stops the whole replica group. Every group gets a port no earlier group of this provisioner
used: a router that still polls a dead group's address must never find the new group there
before the registry says what it is.

By default the groups are this process's children and die with it (``Supervisor``), as
``shardline up`` wants. With ``keep=True`` they are the fleet's, not the controller's: they
outlive it (no parent-death signal), and each is recorded in ``<log dir>/groups/NAME.json``
(pid, its start time, port, fleet), so that any controller of the fleet on this host, a
restarted one or a standby that took over, finds them (:meth:`groups`), adopts them, and can stop
them. A record whose process is gone, or whose pid now names another process (the start time
differs), is a group whose processes exited.

The groups' workers are forked from a fork server that has imported the worker once (started
with the first group): a group then starts without its worker importing torch again, which was
most of the CPU a heal, a rollout's candidate or an autoscaled group cost before its model loads.
A group whose spec sets environment variables starts as a fresh interpreter: the server's modules
were imported under the provisioner's environment. So does a kept group: its record must exist as
soon as its process does, and a controller killed while its fork server still imports (seconds)
would leave a group no record names, which no controller could stop.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from services.common.fork_server import ForkServer, kill_group
from services.common.ports import bindable, free_port
from services.common.supervisor import ManagedProcess, Supervisor
from services.fleet.provisioner import GroupLaunch, GroupProcess

# what the workers' fork server imports: the command line and the worker with its torch
WORKER_MODULES = ["services.cli", "services.cli.serve", "services.worker.server"]
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


def _start_ticks(pid: int) -> int | None:
    """When process ``pid`` started (clock ticks since boot), or None when there is none."""
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


class LocalProvisioner:
    def __init__(self, supervisor: Supervisor, shared_flags: list[str], log_dir: Path, *,
                 port_of: Callable[[], int] = free_port, stop_grace_s: float = STOP_GRACE_S,
                 keep: bool = False, fleet: str = "", fork_server: ForkServer | None = None) -> None:
        """``keep``: the groups outlive this process and are recorded for the fleet's other
        controllers on this host (``fleet`` names whose records are this provisioner's to read).
        ``fork_server``: one its owner shares (``shardline up``'s, which starts every process of
        the stack) and closes; by default the provisioner starts and closes its own."""
        self.supervisor = supervisor
        self.shared_flags = list(shared_flags)  # registry, health store, telemetry: the same for every group
        self.log_dir = log_dir
        self.port_of = port_of
        self.stop_grace_s = stop_grace_s
        self.keep = keep
        self.fleet = fleet
        self.records = log_dir / "groups"
        self._started: dict[str, _Started] = {}
        self._used_ports: set[int] = set()
        self._lock = threading.Lock()
        self._own_fork_server = fork_server is None
        self.fork_server = ForkServer(WORKER_MODULES) if fork_server is None else fork_server

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
                                        log_path=self.log_dir / f"{launch.name}.log", die_with_parent=not self.keep,
                                        track=not self.keep, fork_server=None if self.keep else self.fork_server)
        with self._lock:
            self._started[launch.name] = _Started(launch, managed)
        if self.keep:
            assert managed.proc is not None
            self.records.mkdir(parents=True, exist_ok=True)
            record = {"pid": managed.proc.pid, "start_ticks": _start_ticks(managed.proc.pid), "port": port,
                      "fleet": launch.fleet}
            tmp = self.records / f".{launch.name}.json.tmp"
            tmp.write_text(json.dumps(record))
            tmp.replace(self.records / f"{launch.name}.json")

    def stop(self, name: str) -> None:
        with self._lock:
            started = self._started.pop(name, None)
        record = self._record(name)
        if started is not None:
            proc = started.managed.proc
            assert proc is not None
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGTERM)
            threading.Thread(target=self._reap, args=(started.managed,), name=f"stop-{name}", daemon=True).start()
        elif record is not None and self._alive(record):  # another controller's: by its record
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(record["pid"], signal.SIGTERM)
            threading.Thread(target=self._reap_recorded, args=(record,), name=f"stop-{name}", daemon=True).start()
        # only once the group is told to stop: a controller killed in between leaves the record, by
        # which its successor finds the group and stops it
        (self.records / f"{name}.json").unlink(missing_ok=True)

    def _reap(self, managed: ManagedProcess) -> None:
        assert managed.proc is not None
        with contextlib.suppress(subprocess.TimeoutExpired):
            managed.proc.wait(timeout=self.stop_grace_s)
        self.supervisor.reap(managed)  # SIGKILLs what the process group still holds

    def _reap_recorded(self, record: dict) -> None:
        deadline = time.monotonic() + self.stop_grace_s
        while self._alive(record) and time.monotonic() < deadline:
            time.sleep(0.2)
        kill_group(record["pid"], leader_alive=self._alive(record))  # and what the group still holds (its ranks)

    def _record(self, name: str) -> dict | None:
        try:
            return json.loads((self.records / f"{name}.json").read_text())
        except (OSError, ValueError):
            return None

    @staticmethod
    def _alive(record: dict) -> bool:
        ticks = _start_ticks(record["pid"])
        return ticks is not None and ticks == record.get("start_ticks")

    def _recorded(self) -> list[GroupProcess]:
        """The fleet's groups recorded by any controller on this host (kept groups only)."""
        out = []
        for path in sorted(self.records.glob("*.json")) if self.keep else []:
            record = self._record(path.stem)
            if record is None or record.get("fleet") != self.fleet:
                continue
            alive = self._alive(record)
            out.append(GroupProcess(path.stem, alive, "" if alive else "its worker process is gone",
                                    f"127.0.0.1:{record['port']}"))
        return out

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
        mine = {g.name for g in out}
        return out + [g for g in self._recorded() if g.name not in mine]

    def log_path(self, name: str) -> Path:
        return self.log_dir / f"{name}.log"

    def close(self) -> None:
        """Stop this provisioner's groups; kept ones are the fleet's and go on serving."""
        with self._lock:
            names = list(self._started)
            if self.keep:
                self._started.clear()
                return
        for name in names:
            self.stop(name)
        if self._own_fork_server:
            self.fork_server.close()  # its children were just told to stop
