"""Real service processes for the router tests: start, wait for SERVING, stop (only ours)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from services.common.config import child_environ
from services.common.fork_server import ForkedProcess
from services.common.healthcheck import wait_serving as wait_serving_or_why
from services.common.process_names import rank_of_process
from tests import forks
from tests.stack import free_port

REPO = Path(__file__).resolve().parents[2]


def spawn(argv: list[str], log: Path, *, env: dict[str, str] | None = None) -> subprocess.Popen | ForkedProcess:
    """``shardline *argv``; a service started with this process's environment is forked."""
    return forks.start(argv, log, env or child_environ(), forked=env is None)


def start_service(name: str, flags: list[str], log: Path) -> tuple[subprocess.Popen | ForkedProcess, str]:
    port = free_port()
    return spawn(["serve", name, "--port", str(port), *flags], log), f"127.0.0.1:{port}"


def wait_serving(proc: subprocess.Popen, address: str, log: Path, timeout_s: float = 120.0) -> None:
    problem = wait_serving_or_why(proc, address, timeout_s=timeout_s)
    if problem:
        stop(proc)
        pytest.fail(f"{problem}:\n{log.read_text()}")


def wait_healthy(http: str, timeout_s: float = 30.0) -> None:
    """Until the router's /health is 200: it has seen a replica group report (SERVING on gRPC
    comes first)."""
    deadline = time.monotonic() + timeout_s
    while httpx.get(f"{http}/health", timeout=5).status_code != 200:
        assert time.monotonic() < deadline, f"{http}/health not 200 within {timeout_s} s"
        time.sleep(0.1)


def stop(proc: subprocess.Popen, timeout_s: float = 30.0) -> int:
    """SIGTERM, then SIGKILL of the process group if it does not exit (its ranks go with it)."""
    if proc.poll() is None:
        proc.terminate()
    try:
        return proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        return proc.wait()


@dataclass(frozen=True)
class RouterStack:
    http: str  # http://127.0.0.1:PORT (no /v1)
    router: str  # the router's gRPC host:port
    worker: str  # the worker's gRPC host:port


@contextlib.contextmanager
def router_and_worker(model_dir: Path, logs: Path, *, worker_flags: list[str] = (),
                      router_flags: list[str] = (), worker_timeout_s: float = 120.0) -> Iterator[RouterStack]:
    """One worker (a replica group) on ``model_dir`` and a router in front of it with HTTP, both
    real processes; stopped (router first) when the block ends, and the router must exit 0
    with no traceback in its log."""
    worker, worker_address = start_service("worker", ["--model", str(model_dir), *worker_flags], logs / "worker.log")
    procs = [worker]
    try:
        wait_serving(worker, worker_address, logs / "worker.log", timeout_s=worker_timeout_s)
        http_port = free_port()
        router, router_address = start_service("router", [
            "--model", str(model_dir), "--worker", worker_address, "--http-port", str(http_port), *router_flags],
            logs / "router.log")
        procs.append(router)
        wait_serving(router, router_address, logs / "router.log", timeout_s=30)
        wait_healthy(f"http://127.0.0.1:{http_port}")
        yield RouterStack(f"http://127.0.0.1:{http_port}", router_address, worker_address)
    finally:
        codes = [stop(p, timeout_s=20) for p in reversed(procs)]
    router_log = (logs / "router.log").read_text()
    assert codes[0] == 0, router_log
    assert "Traceback" not in router_log, router_log


def serving_pid(service: str, port_number: int) -> int:
    """The pid of ``shardline serve SERVICE --port PORT`` (not a rank forked from it, which shares
    its command line)."""
    port = str(port_number)
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            args = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue
        if ("serve" in args and service in args and any(a == "--port" and b == port for a, b in zip(args, args[1:]))
                and rank_of_process(int(pid)) is None):
            return int(pid)
    raise AssertionError(f"no {service} on port {port}")


@contextlib.contextmanager
def running_up(argv: list[str], env: dict[str, str], out: Path, *, timeout_s: float = 240.0) -> Iterator[Path]:
    """`shardline up` (``argv`` from ``test_up.up_command``) until it says it is up; stopped as
    :func:`stop` does when the block ends. Yields the file its output goes to."""
    with out.open("w") as log:
        proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)
    try:
        deadline = time.monotonic() + timeout_s
        while "shardline is up" not in out.read_text():
            assert proc.poll() is None, out.read_text()
            assert time.monotonic() < deadline, out.read_text()
            time.sleep(0.2)
        yield out
    finally:
        stop(proc, timeout_s=60)
