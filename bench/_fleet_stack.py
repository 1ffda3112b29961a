"""A fleet under load, as ``bench.fleet`` and the fleet tests run it: real processes throughout.

:class:`FleetStack` is a router (registry discovery) and a fleet controller (``shardline serve
fleet``, local provisioner) on one registry, plus ``shardline apply`` for each spec change. With
``keep_groups`` the groups outlive the controller (``--keep-groups``), so that
:meth:`FleetStack.kill_controller` can SIGKILL it and start another that adopts them.
:class:`Load` keeps N greedy streams going through the real ``openai`` client, checking every
completion against its fault-free text. :class:`RotationMonitor` samples the router's view of the
groups (how many are in rotation, their KV utilization) every quarter second.
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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import httpx
import openai
import yaml

from services.cli.fleet import fleet_status
from services.common.config import child_environ
from services.common.fork_server import live_process
from services.common.healthcheck import check
from services.common.logging import STACKS_SIGNAL
from services.common.ports import free_port
from services.common.process_names import rank_of_process
from services.common.proto import common_pb2, router_pb2, router_pb2_grpc
from services.common.registry import ShardRegistry

REPO = Path(__file__).resolve().parents[1]
IN_ROTATION = (common_pb2.REPLICA_GROUP_STATUS_HEALTHY, common_pb2.REPLICA_GROUP_STATUS_DEGRADED)


def driver_pid(group: str) -> int:
    """The pid of a replica group's worker process (its driver), found by its --replica-group-id."""
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                args = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if b"worker" in args and group.encode() in args and rank_of_process(int(pid)) is None:
                return int(pid)  # not a forked rank, which shares its worker's command line
    raise RuntimeError(f"no worker process of {group}")


def fleet_spec(name: str, model_dir: Path, *, replicas: int = 2, tp: int = 1, pp: int = 1, dtype: str = "bfloat16",
               kv_cache_cap_gb: float = 0.004, env: dict[str, str] | None = None,
               autoscaling: dict[str, Any] | None = None, gate_chunks: int = 4, gate_chunk_tokens: int = 512,
               drain_deadline_s: float = 10.0, settle_s: float = 3.0,
               collective_timeout_s: float | None = None) -> dict[str, Any]:
    group: dict[str, Any] = {"name": name, "tp_degree": tp, "pp_degree": pp, "dtype": dtype,
                             "kv_cache_cap_gb": kv_cache_cap_gb, "checkpoint": {"model_dir": str(model_dir)}}
    if collective_timeout_s is not None:
        group["collective_timeout_s"] = collective_timeout_s
    if env:
        group["env"] = env
    spec: dict[str, Any] = {"replica_group": group, "replicas": replicas, "served_model_name": name,
                            "rollout": {"drain_deadline_s": drain_deadline_s, "settle_s": settle_s,
                                        "gate": {"threshold_pct": 1.0, "chunks": gate_chunks,
                                                 "chunk_tokens": gate_chunk_tokens}}}
    if autoscaling:
        spec["autoscaling"] = autoscaling
    return spec


class FleetStack:
    def __init__(self, workdir: Path, model_dir: Path, fleet: str, registry_url: str, *,
                 redis_url: str | None = None, telemetry: str | None = None,
                 worker_flags: tuple[str, ...] = (), keep_groups: bool = False) -> None:
        self.workdir, self.model_dir, self.fleet = workdir, model_dir, fleet
        self.keep_groups = keep_groups
        self.controllers = 0  # started so far
        self.registry_url, self.redis_url, self.telemetry = registry_url, redis_url, telemetry
        self.worker_flags = worker_flags
        self.logs = workdir / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.procs: list[subprocess.Popen] = []
        self.router_port, self.http_port, self.fleet_port = free_port(), free_port(), free_port()
        self.http = f"http://127.0.0.1:{self.http_port}"
        self.router = f"127.0.0.1:{self.router_port}"
        self.revisions = 0

    def _spawn(self, name: str, argv: list[str]) -> subprocess.Popen:
        with (self.logs / f"{name}.log").open("ab") as out:
            proc = subprocess.Popen([sys.executable, "-m", "services.cli", *argv], cwd=REPO, stdout=out,
                                    stderr=subprocess.STDOUT, env=child_environ(), start_new_session=True)
        self.procs.append(proc)
        return proc

    def _run(self, argv: list[str]) -> str:
        done = subprocess.run([sys.executable, "-m", "services.cli", *argv], cwd=REPO, env=child_environ(), text=True,
                              capture_output=True, timeout=120)
        if done.returncode != 0:
            raise RuntimeError(f"shardline {' '.join(argv)} exited {done.returncode}:\n{done.stdout}{done.stderr}")
        return done.stdout

    def apply(self, spec: dict[str, Any]) -> str:
        self.revisions += 1
        path = self.workdir / f"fleet-{self.revisions}.yaml"
        path.write_text(yaml.safe_dump(spec))
        return self._run(["apply", "-f", str(path), "--registry-url", self.registry_url]).strip()

    def start(self, spec: dict[str, Any], *, groups: int, timeout_s: float = 180.0) -> None:
        """Apply ``spec``, start the controller and the router, and wait for ``groups`` in rotation."""
        self.apply(spec)
        self.start_controller()
        self.wait(lambda: self.in_rotation_registry() >= groups, timeout_s, f"{groups} groups in rotation")
        self.router_proc = self._spawn("router", [
            "serve", "router", "--port", str(self.router_port), "--http-port", str(self.http_port),
            "--model", str(self.model_dir), "--served-model-name", self.fleet, *self._shared()])
        self.wait(lambda: self._serving(self.router), 60, "the router SERVING")
        self.wait(lambda: len(self.rotation()) >= groups, 30, f"the router sees {groups} groups in rotation")

    def _shared(self) -> list[str]:
        return ["--registry-url", self.registry_url, *(["--redis-url", self.redis_url] if self.redis_url else [])]

    def start_controller(self) -> None:
        """``shardline serve fleet`` for the fleet (applied first), reading the router's committed KV."""
        self.controller = self._spawn("fleet", [
            "serve", "fleet", "--port", str(self.fleet_port), "--fleet", self.fleet, "--log-dir", str(self.logs),
            "--interval", "0.5", "--router", self.router, *self._shared(),
            *(["--telemetry", self.telemetry] if self.telemetry else []),
            *(["--keep-groups"] if self.keep_groups else []),
            *(f"--worker-flag={f}" for f in self.worker_flags)])
        self.controllers += 1

    def kill_controller(self) -> None:
        """SIGKILL the controller (the kept groups serve on) and start a new one in its place."""
        assert self.keep_groups, "without --keep-groups the groups die with the controller"
        os.kill(self.controller.pid, signal.SIGKILL)
        self.controller.wait(timeout=10)
        self.procs.remove(self.controller)
        self.start_controller()

    @staticmethod
    def _serving(address: str) -> bool:
        try:
            return check(address, timeout_s=1.0) == "SERVING"
        except Exception:  # noqa: BLE001 - not yet
            return False

    def wait(self, condition: Callable[[], bool], timeout_s: float, what: str) -> float:
        start = time.monotonic()
        while not condition():
            for proc in self.procs:
                if proc.poll() is not None:
                    raise RuntimeError(f"{proc.args[3:5]} exited {proc.returncode} while waiting for {what}:\n"
                                       f"{self.log_tail()}")
            if time.monotonic() - start > timeout_s:
                # the controller's threads, where they are now, after its events
                os.kill(self.controller.pid, STACKS_SIGNAL)
                time.sleep(1.0)
                raise TimeoutError(f"no {what} within {timeout_s:g} s:\n{self.log_tail(150)}")
            time.sleep(0.25)
        return time.monotonic() - start

    def status(self) -> dict[str, Any]:
        with ShardRegistry(self.registry_url) as registry:
            return fleet_status(registry, self.fleet)

    def rollout(self) -> dict[str, Any]:
        return json.loads(self._run(["rollout", "status", "--fleet", self.fleet, "--json",
                                     "--registry-url", self.registry_url]))

    def in_rotation_registry(self) -> int:
        try:
            return self.status()["in_rotation"]
        except Exception:  # noqa: BLE001 - the fleet is not applied yet
            return 0

    def rotation(self) -> list[router_pb2.ReplicaGroupInfo]:
        """The groups the router has in rotation now."""
        with grpc.insecure_channel(self.router) as channel:
            groups = router_pb2_grpc.RouterServiceStub(channel).ListReplicaGroups(
                router_pb2.ListReplicaGroupsRequest(), timeout=5).groups
        return [g for g in groups if g.status in IN_ROTATION]

    def log_tail(self, lines: int = 40) -> str:
        path = self.logs / "fleet.log"
        text = path.read_text(errors="replace").splitlines()[-lines:] if path.exists() else []
        return "\n".join(text)

    def events(self) -> list[tuple[float, str]]:
        """The controller's events: (Unix time, ``EVENT key=value ...``) from its ``T fleet NAME: ...`` lines."""
        path = self.logs / "fleet.log"
        marker = f" fleet {self.fleet}: "
        out = []
        for line in path.read_text(errors="replace").splitlines() if path.exists() else []:
            stamp, found, rest = line.partition(marker)
            if found:
                with contextlib.suppress(ValueError):
                    out.append((float(stamp), rest))
        return out

    def close(self) -> None:
        for proc in reversed(self.procs):
            if proc.poll() is None:
                proc.terminate()
        for proc in reversed(self.procs):
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, 9)
                proc.wait()
        self._stop_kept_groups()

    def _stop_kept_groups(self, grace_s: float = 15.0) -> None:
        """The groups a controller kept (they outlive it by design): by their records."""
        pids = []
        for path in (self.logs / "groups").glob("*.json"):
            with contextlib.suppress(OSError, ValueError, KeyError):
                pids.append(json.loads(path.read_text())["pid"])
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while pids and time.monotonic() < deadline and any(live_process(pid) for pid in pids):
            time.sleep(0.2)
        for pid in pids:  # and what their process groups still hold (ranks)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)


@dataclass
class Outcome:
    prompt: int
    start: float
    end: float
    text: str
    error: str = ""
    groups: tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        return not self.error


@dataclass
class Load:
    """``concurrency`` streams looping over ``prompts`` until stopped; every outcome kept."""

    http: str
    model: str
    prompts: list[str]
    max_tokens: int
    concurrency: int = 8
    pause_s: float = 0.0  # each stream's think time between two requests
    ignore_eos: bool = False  # every request generates its whole max_tokens
    outcomes: list[Outcome] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._loop, args=(i,), daemon=True) for i in range(self.concurrency)]
        self.client = openai.OpenAI(base_url=f"{self.http}/v1", api_key="none", max_retries=0, timeout=120,
                                    http_client=httpx.Client(timeout=120))

    def one(self, index: int) -> Outcome:
        start = time.monotonic()
        parts: list[str] = []
        groups: list[str] = []
        try:
            stream = self.client.completions.create(model=self.model, prompt=self.prompts[index], stream=True,
                                                    max_tokens=self.max_tokens, temperature=0.0,
                                                    extra_body={"ignore_eos": True} if self.ignore_eos else None)
            for chunk in stream:
                group = (chunk.model_extra or {}).get("replica_group_id", "")
                if group and (not groups or groups[-1] != group):
                    groups.append(group)
                parts.extend(c.text for c in chunk.choices)
            return Outcome(index, start, time.monotonic(), "".join(parts), groups=tuple(groups))
        except Exception as exc:  # noqa: BLE001 - every failure is an outcome to report
            return Outcome(index, start, time.monotonic(), "".join(parts), f"{type(exc).__name__}: {exc}",
                           tuple(groups))

    def _loop(self, worker: int) -> None:
        n = worker
        while not self._stop.is_set():
            outcome = self.one(n % len(self.prompts))
            with self._lock:
                self.outcomes.append(outcome)
            n += self.concurrency
            self._stop.wait(self.pause_s)

    def start(self) -> Load:
        for thread in self._threads:
            thread.start()
        return self

    def stop(self) -> list[Outcome]:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=180)
        return list(self.outcomes)


class RotationMonitor:
    """Samples (time, groups in rotation, mean committed KV utilization %) from the router every ``every_s``."""

    def __init__(self, stack: FleetStack, every_s: float = 0.25) -> None:
        self.stack, self.every_s = stack, every_s
        self.samples: list[tuple[float, int, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            try:
                groups = self.stack.rotation()
            except grpc.RpcError:
                continue
            # what the router has committed (in use + its admitted requests' claims): the autoscaler's signal
            utils = [min(1.0, g.kv_bytes_committed / g.kv_bytes_capacity) for g in groups if g.kv_bytes_capacity]
            self.samples.append((time.monotonic(), len(groups), 100 * sum(utils) / len(utils) if utils else 0.0))

    def start(self) -> RotationMonitor:
        self._thread.start()
        return self

    def stop(self) -> list[tuple[float, int, float]]:
        self._stop.set()
        self._thread.join(timeout=10)
        return list(self.samples)
