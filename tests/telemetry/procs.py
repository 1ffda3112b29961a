"""Real `shardline serve telemetry` / `serve worker` processes for the telemetry tests."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from services.common.fork_server import ForkedProcess
from services.common.healthcheck import wait_serving
from services.common.proto import telemetry_pb2, telemetry_pb2_grpc
from tests import forks
from tests.stack import free_port

REPO = Path(__file__).resolve().parents[2]


@dataclass
class Service:
    proc: subprocess.Popen | ForkedProcess
    address: str
    log: Path
    metrics_port: int | None = None

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.metrics_port}/metrics"

    def stop(self, timeout_s: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)  # a test may have stopped it
            self.proc.terminate()
        try:
            return self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()


def start_service(name: str, log: Path, *flags: str, env: dict | None = None, metrics: bool = True,
                  timeout_s: float = 120.0, port: int | None = None) -> Service:
    port = port or free_port()
    metrics_port = free_port() if metrics else None
    argv = ["serve", name, "--port", str(port), *flags]
    if metrics_port is not None:
        argv += ["--metrics-port", str(metrics_port)]
    proc = forks.start(argv, log, {**os.environ, **(env or {})}, forked=not env, append=True)
    service = Service(proc, f"127.0.0.1:{port}", log, metrics_port)
    problem = wait_serving(proc, service.address, timeout_s=timeout_s)
    if problem:
        service.stop()
        pytest.fail(f"{name} {problem}:\n{log.read_text()}")
    return service


def telemetry_stub(address: str) -> tuple[grpc.Channel, telemetry_pb2_grpc.TelemetryServiceStub]:
    channel = grpc.insecure_channel(address)
    return channel, telemetry_pb2_grpc.TelemetryServiceStub(channel)


def query_counts(stub, replica_group_id: str) -> dict[tuple[str, str], int]:
    """``{(gpu_id, op_type): count}`` over the current windows."""
    response = stub.Query(telemetry_pb2.QueryRequest(replica_group_id=replica_group_id), timeout=5)
    return {(w.gpu_id, w.op_type): w.count for w in response.windows}


def scrape(url: str) -> dict[str, list]:
    """Samples by name: ``{sample_name: [(labels, value), ...]}``."""
    with urllib.request.urlopen(url, timeout=5) as response:
        text = response.read().decode()
    out: dict[str, list] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out.setdefault(sample.name, []).append((sample.labels, sample.value))
    return out


def wait_until(predicate, timeout_s: float, interval_s: float = 0.2):
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(interval_s)


def alerts_reader(address: str, group: str) -> tuple[list, threading.Event, grpc.Channel]:
    """Collect the Alerts stream of ``group`` on a thread."""
    channel, stub = telemetry_stub(address)
    got: list = []
    done = threading.Event()

    def read() -> None:
        try:
            for alert in stub.Alerts(telemetry_pb2.AlertsRequest(replica_group_id=group)):
                got.append(alert)
        except grpc.RpcError:
            pass
        done.set()

    threading.Thread(target=read, daemon=True).start()
    return got, done, channel
