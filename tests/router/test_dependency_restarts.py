"""Redis and PostgreSQL restarted while a router and a worker (tiny model) serve: real
processes, the dependencies of this test's own (tests/restartable.py), greedy requests
streaming through the router the whole time. No request may fail, and the worker's
heartbeats reach the restarted server again by themselves."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import grpc
import pytest
import redis

from services.common.proto import common_pb2, router_pb2, router_pb2_grpc
from services.common.registry import ShardRegistry
from services.worker.driver import HEARTBEAT_S
from tests.ranks import rank_pids
from tests.restartable import postgres_server, redis_server
from tests.router.processes import start_service, stop, wait_serving
from tests.stack import free_port

pytestmark = pytest.mark.slow

GROUP = "rg-restart"
SHARD = f"{GROUP}:pp0-tp0"
PROMPT = [1, 5, 9, 14, 3]
SLACK_S = 1.5  # a heartbeat due right after the restart may be waiting out a failed one's interval


@dataclass
class Traffic:
    """Greedy requests back to back through the router until stopped; every outcome kept."""

    router: router_pb2_grpc.RouterServiceStub
    completions: list[tuple[int, ...]] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)

    def _one(self) -> None:
        request = router_pb2.RouterGenerateRequest(
            sampling=common_pb2.SamplingParameters(temperature=0, max_tokens=6))
        request.token_ids.ids.extend(PROMPT)
        try:
            responses = list(self.router.Generate(request, timeout=30))
        except grpc.RpcError as exc:
            self.failures.append(f"{time.strftime('%H:%M:%S')} {exc.code().name}: {exc.details()}")
            time.sleep(0.05)
            return
        self.completions.append(tuple(r.token.token_id for r in responses if r.HasField("token")))

    def _run(self) -> None:
        while not self._stop.is_set():
            self._one()

    @contextmanager
    def running(self) -> Iterator[Traffic]:
        thread = threading.Thread(target=self._run, name="traffic", daemon=True)
        thread.start()
        try:
            yield self
        finally:
            self._stop.set()
            thread.join(timeout=35)

    def check(self, at_least: int) -> None:
        assert not self.failures, f"{len(self.failures)} requests failed: {self.failures[:5]}"
        assert len(self.completions) >= at_least, f"only {len(self.completions)} requests completed"
        assert len(set(self.completions)) == 1, "greedy completions of one prompt differ"
        assert len(self.completions[0]) == 6


@contextmanager
def serving(tiny_model_dir: Path, logs: Path, worker_flags: list[str], router_flags: list[str]
            ) -> Iterator[router_pb2_grpc.RouterServiceStub]:
    """A worker of the tiny model and a router in front of it, both stopped cleanly after."""
    worker, worker_address = start_service("worker", [
        "--model", str(tiny_model_dir), "--served-model-name", "tiny", "--kv-cache-gb", "0.01",
        "--replica-group-id", GROUP, *worker_flags], logs / "worker.log")
    procs = [worker]
    try:
        wait_serving(worker, worker_address, logs / "worker.log")
        router, router_address = start_service("router", [
            "--model", str(tiny_model_dir), "--served-model-name", "tiny", "--worker", worker_address,
            "--http-port", str(free_port()), *router_flags], logs / "router.log")
        procs.append(router)
        wait_serving(router, router_address, logs / "router.log", timeout_s=30)
        with grpc.insecure_channel(router_address) as channel:
            yield router_pb2_grpc.RouterServiceStub(channel)
    finally:
        codes = [stop(proc, timeout_s=20) for proc in reversed(procs)]
    for name in ("router", "worker")[:len(codes)]:
        assert "Traceback" not in (logs / f"{name}.log").read_text(), (logs / f"{name}.log").read_text()
    assert codes == [0] * len(codes), [(logs / "router.log").read_text(), (logs / "worker.log").read_text()]


def wait_for(condition, timeout_s: float, what: str) -> float:
    """Seconds until ``condition()`` held; fails after ``timeout_s``."""
    started = time.monotonic()
    while not condition():
        assert time.monotonic() - started < timeout_s, f"{what} not within {timeout_s} s"
        time.sleep(0.05)
    return time.monotonic() - started


def last_heartbeat(registry_url: str) -> datetime:
    with ShardRegistry(registry_url) as registry:
        return registry.get_shard(SHARD).last_heartbeat


def test_redis_restart_while_serving(tiny_model_dir: Path, tmp_path: Path) -> None:
    registry_url = f"sqlite:///{tmp_path / 'registry.db'}"
    with redis_server() as own_redis, serving(
            tiny_model_dir, tmp_path, ["--redis-url", own_redis.url, "--registry-url", registry_url],
            ["--redis-url", own_redis.url]) as router:
        client = redis.Redis.from_url(own_redis.url, decode_responses=True)
        health_key = f"shardhealth:{GROUP}"
        wait_for(lambda: client.exists(health_key), 5, "the first heartbeat")
        time.sleep(0.75)  # the router's poll (every 0.25 s) has read the entry: it counts on the store now
        with Traffic(router).running() as traffic:
            wait_for(lambda: len(traffic.completions) >= 3, 20, "requests before the restart")
            own_redis.stop()
            down_at = datetime.now(UTC)
            time.sleep(2.5)
            # the registry's heartbeat does not wait on the health store's
            assert last_heartbeat(registry_url) > down_at, "registry heartbeats stopped with Redis"
            served_while_down = len(traffic.completions)
            # the worst moment: right after a failed beat, so a whole interval passes before the
            # worker writes the emptied store again while the router keeps reading it
            failed_beats = (tmp_path / "worker.log").read_text().count("health store heartbeat failed")
            wait_for(lambda: (tmp_path / "worker.log").read_text().count("health store heartbeat failed")
                     > failed_beats, HEARTBEAT_S + SLACK_S, "a failed heartbeat")
            own_redis.start()
            took = wait_for(lambda: client.exists(health_key), HEARTBEAT_S + SLACK_S,
                            "the worker's heartbeat keys after the restart")
            assert client.hgetall(health_key) == {"pp0_tp0": "healthy"}
            assert client.zscore(f"shardhealth_seen:{GROUP}", "pp0_tp0") is not None
            assert client.zscore("shardhealth_groups", GROUP) is not None
            wait_for(lambda: client.zscore("replica_kv_util", GROUP) is not None, HEARTBEAT_S + SLACK_S,
                     "KV utilization after the restart")
            # keep serving across the window where the router reads the emptied store
            time.sleep(2 * HEARTBEAT_S)
        client.close()
    print(f"heartbeat keys back {took:.2f} s after the restart; {len(traffic.completions)} requests, "
          f"{served_while_down} by the end of the outage")
    traffic.check(at_least=served_while_down + 3)


def test_postgres_restart_while_serving(tiny_model_dir: Path, tmp_path: Path) -> None:
    with postgres_server() as own_pg, serving(
            tiny_model_dir, tmp_path, ["--registry-url", own_pg.url],
            ["--registry-url", own_pg.url]) as router:
        wait_for(lambda: last_heartbeat(own_pg.url) is not None, 5, "the first registry heartbeat")
        with Traffic(router).running() as traffic:
            wait_for(lambda: len(traffic.completions) >= 3, 20, "requests before the restart")
            own_pg.stop()
            time.sleep(2.0)
            own_pg.start()
            restarted_at = datetime.now(UTC)
            took = wait_for(lambda: last_heartbeat(own_pg.url) > restarted_at, HEARTBEAT_S + SLACK_S,
                            "a registry heartbeat after the restart")
            served = len(traffic.completions)
            time.sleep(HEARTBEAT_S)
        with ShardRegistry(own_pg.url) as registry:
            assert registry.list_groups()[0].status == "healthy"
    print(f"registry heartbeat back {took:.2f} s after the restart; {len(traffic.completions)} requests")
    traffic.check(at_least=served + 1)


def test_a_worker_stops_cleanly_while_its_stores_are_down(tiny_model_dir: Path, tmp_path: Path) -> None:
    """SIGTERM while Redis and PostgreSQL are both down: the worker cannot record its stop, says
    so, and exits 0 promptly (its entries expire; the registry row is judged by its heartbeats)."""
    with redis_server() as own_redis, postgres_server() as own_pg:
        worker, address = start_service("worker", [
            "--model", str(tiny_model_dir), "--served-model-name", "tiny", "--kv-cache-gb", "0.01",
            "--replica-group-id", GROUP, "--redis-url", own_redis.url, "--registry-url", own_pg.url],
            tmp_path / "worker.log")
        wait_serving(worker, address, tmp_path / "worker.log")
        own_redis.stop()
        own_pg.stop()
        time.sleep(HEARTBEAT_S + 0.5)  # a heartbeat against both stores down
        started = time.monotonic()
        code = stop(worker, timeout_s=20)
        took = time.monotonic() - started
    log = (tmp_path / "worker.log").read_text()
    assert code == 0, log
    assert "Traceback" not in log, log
    assert took < 10, f"the worker took {took:.1f} s to stop"
    assert "health store heartbeat failed" in log and "registry heartbeat failed" in log


def test_a_group_failure_reaches_the_registry_while_redis_is_down(tiny_model_dir: Path, tmp_path: Path) -> None:
    """A rank dies while the health store is down: the worker still marks its group dead in the
    registry (the router's discovery and the planner read it there)."""
    registry_url = f"sqlite:///{tmp_path / 'registry.db'}"
    with redis_server() as own_redis:
        worker, address = start_service("worker", [
            "--model", str(tiny_model_dir), "--served-model-name", "tiny", "--kv-cache-gb", "0.01", "--tp", "2",
            "--collective-timeout", "1", "--replica-group-id", GROUP, "--redis-url", own_redis.url,
            "--registry-url", registry_url], tmp_path / "worker.log")
        try:
            wait_serving(worker, address, tmp_path / "worker.log")
            own_redis.stop()
            (rank,) = rank_pids(worker.pid)
            os.kill(rank, signal.SIGKILL)
            with ShardRegistry(registry_url) as registry:
                wait_for(lambda: registry.list_groups()[0].status == "dead", 15, "the group dead in the registry")
        finally:
            stop(worker, timeout_s=20)
    assert "could not record the failure in the health store" in (tmp_path / "worker.log").read_text()
