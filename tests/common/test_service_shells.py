"""Service shells: each of the five services starts with `shardline serve <name>`, answers the
gRPC health check SERVING within 10 s, lists itself by reflection (--dev), answers an RPC sanely, and
exits 0 on SIGTERM. Plus the pieces the
shells are built from: config precedence, the error-to-status table, graceful stop."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from services.common import errors
from services.common.config import DEFAULT_PORTS, ServerConfig, add_server_arguments, child_environ, resolve
from services.common.grpc_server import STATUS_FOR_ERROR, ServiceBinding, start_server
from services.common.proto import (
    loader_pb2,
    loader_pb2_grpc,
    planner_pb2,
    planner_pb2_grpc,
    router_pb2,
    router_pb2_grpc,
    telemetry_pb2,
    telemetry_pb2_grpc,
    worker_pb2,
    worker_pb2_grpc,
)
from tests.busy import OwnClock
from tests.stack import free_port

REPO = Path(__file__).resolve().parents[2]
# each service's start-up budget, in its own time: beside other tests, its waits for a CPU do not count
# (with 3 busy loops on the 2-core AVX2 EPYC a worker took 9.4 s on the wall clock and 6.8 s of its own,
# the loader 8.2 s and 4.7 s; alone each is SERVING in about 3 s)
SERVING_DEADLINE_S = 10.0
WALL_LIMIT_S = 60.0


@dataclass(frozen=True)
class Shell:
    name: str
    full_name: str
    needs_model: bool = False
    call_built: Callable[[grpc.Channel], bool] | None = None  # a built RPC's answer is sane


SHELLS = [
    Shell("planner", "shardline.v1.PlannerService", call_built=lambda ch: _rejects_empty_plan(ch)),
    Shell("loader", "shardline.v1.LoaderService", call_built=lambda ch: list(
        loader_pb2_grpc.LoaderServiceStub(ch).ListManifests(loader_pb2.ListManifestsRequest(), timeout=5).manifests)
        == []),
    Shell("worker", "shardline.v1.WorkerService", needs_model=True, call_built=lambda ch: (
        lambda stats: stats.blocks_total > 0 and stats.block_size == 16)(
        worker_pb2_grpc.WorkerServiceStub(ch).Stats(worker_pb2.StatsRequest(), timeout=5))),
    Shell("router", "shardline.v1.RouterService", call_built=lambda ch: _router_without_model(ch)),
    Shell("telemetry", "shardline.v1.TelemetryService", call_built=lambda ch: isinstance(
        telemetry_pb2_grpc.TelemetryServiceStub(ch).Query(telemetry_pb2.QueryRequest(), timeout=5),
        telemetry_pb2.QueryResponse)),
]


def _rejects_empty_plan(channel: grpc.Channel) -> bool:
    """A built planner answers an empty PlanRequest with INVALID_ARGUMENT naming what is missing."""
    try:
        planner_pb2_grpc.PlannerServiceStub(channel).Plan(planner_pb2.PlanRequest(), timeout=5)
    except grpc.RpcError as exc:
        return exc.code() == grpc.StatusCode.INVALID_ARGUMENT and "model_preset" in exc.details()
    return False


def _router_without_model(channel: grpc.Channel) -> bool:
    """A router started without a model answers Generate with NOT_FOUND saying how to give it one."""
    try:
        list(router_pb2_grpc.RouterServiceStub(channel).Generate(router_pb2.RouterGenerateRequest(text="hello"),
                                                                 timeout=5))
    except grpc.RpcError as exc:
        return exc.code() == grpc.StatusCode.NOT_FOUND and "--model" in exc.details()
    return False


def _service_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    """The caller's environment without SHARDLINE_* settings, so the test is hermetic, and the
    embedded registry under ``tmp_path``, not in the user's state directory (which the planner and
    the loader open at start, and parallel tests would share)."""
    return child_environ(SHARDLINE_STATE_DIR=str(tmp_path / "state"), **extra)


def _health(channel: grpc.Channel, service: str = "") -> str:
    response = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service), timeout=1)
    return health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)


def _wait_serving(proc: subprocess.Popen, channel: grpc.Channel, log: Path, deadline_s: float) -> float:
    """The service's own seconds (see tests/busy.py) until the health check says SERVING; fails
    once they pass ``deadline_s``, or the wall clock passes WALL_LIMIT_S."""
    clock = OwnClock(proc.pid)
    while clock.seconds() < deadline_s and clock.wall() < WALL_LIMIT_S:
        if proc.poll() is not None:
            pytest.fail(f"exited with {proc.returncode} before serving:\n{log.read_text()}")
        try:
            if _health(channel) == "SERVING":
                return clock.seconds()
        except grpc.RpcError:
            pass
        time.sleep(0.05)
    pytest.fail(f"not SERVING within {deadline_s} s of its own time ({clock.wall():.1f} s on the wall clock):\n"
                f"{log.read_text()}")


@pytest.fixture
def processes() -> Iterator[list[subprocess.Popen]]:
    """Processes a test started; any still running at the end are killed (only these)."""
    started: list[subprocess.Popen] = []
    yield started
    for proc in started:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)


def test_five_services_serve_health_reflection_an_rpc_and_exit_0_on_sigterm(
    tmp_path: Path, processes: list[subprocess.Popen], tiny_model_dir: Path
) -> None:
    running: list[tuple[Shell, subprocess.Popen, grpc.Channel, Path]] = []
    try:
        # One after another, each timed from its own start: five interpreters importing at
        # once on a small machine would measure their contention, not the service.
        for shell in SHELLS:
            port = free_port()
            log = tmp_path / f"{shell.name}.log"
            env = _service_env(tmp_path, SHARDLINE_DEV="1")  # reflection is served in development mode only
            command = [sys.executable, "-m", "services.cli", "serve", shell.name]
            if shell.name == "telemetry":
                # Configured through the environment instead of flags, as docker-compose does.
                env.update(SHARDLINE_HOST="127.0.0.1", SHARDLINE_PORT=str(port))
            else:
                command += ["--port", str(port)]
            if shell.name == "router":
                command += ["--http-port", "-1"]  # no HTTP front door: port 8000 may be taken
            if shell.needs_model:
                command += ["--model", str(tiny_model_dir), "--kv-cache-gb", "0.05"]
            with log.open("wb") as out:
                proc = subprocess.Popen(command, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)
            processes.append(proc)
            channel = grpc.insecure_channel(f"127.0.0.1:{port}")
            running.append((shell, proc, channel, log))
            _wait_serving(proc, channel, log, SERVING_DEADLINE_S)

        for shell, _proc, channel, _log in running:
            assert _health(channel, shell.full_name) == "SERVING"
            services = ProtoReflectionDescriptorDatabase(channel).get_services()
            assert shell.full_name in services and "grpc.health.v1.Health" in services
            assert shell.call_built(channel), shell.name
    finally:
        for _shell, _proc, channel, _log in running:
            channel.close()

    for _shell, proc, _channel, _log in running:
        proc.send_signal(signal.SIGTERM)
    for shell, proc, _channel, log in running:
        assert proc.wait(timeout=15) == 0, log.read_text()
        text = log.read_text()
        assert "SIGTERM" in text and f"{shell.name} stopped" in text
        assert "Traceback" not in text


def test_sigint_also_exits_0(tmp_path: Path, processes: list[subprocess.Popen]) -> None:
    port = free_port()
    log = tmp_path / "loader.log"
    with log.open("wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "services.loader", "--port", str(port)],
                                cwd=REPO, env=_service_env(tmp_path), stdout=out, stderr=subprocess.STDOUT)
    processes.append(proc)
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        _wait_serving(proc, channel, log, SERVING_DEADLINE_S)
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=15) == 0, log.read_text()
    assert "Traceback" not in log.read_text()


def test_taken_port_fails_loudly(tmp_path: Path) -> None:
    """grpc would share a port through SO_REUSEPORT; we refuse, so two services never split traffic."""
    holder = start_server(ServerConfig(service="planner", port=0), [])
    try:
        result = subprocess.run([sys.executable, "-m", "services.planner", "--port", str(holder.port)],
                                cwd=REPO, env=_service_env(tmp_path), capture_output=True, text=True, timeout=30)
    finally:
        holder.stop(0)
    assert result.returncode == 1
    assert f"cannot bind 127.0.0.1:{holder.port} for planner" in result.stderr


def test_bad_env_setting_exits_2_naming_the_variable() -> None:
    env = child_environ(SHARDLINE_PORT="fifty")
    result = subprocess.run([sys.executable, "-m", "services.router"], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=30)
    assert result.returncode == 2
    assert "SHARDLINE_PORT='fifty' is not a valid int" in result.stderr


# --- config -------------------------------------------------------------------------------


def test_flag_beats_env_beats_default() -> None:
    env = {"SHARDLINE_PORT": "7000", "SHARDLINE_ROUTER_PORT": "7001", "SHARDLINE_HOST": "0.0.0.0"}
    assert resolve("port", 6000, 1, environ=env) == 6000
    assert resolve("port", None, 1, environ=env) == 7000
    assert resolve(("router_port", "port"), None, 1, environ=env) == 7001
    assert resolve("missing", None, 1, environ=env) == 1
    assert resolve("flag", None, False, environ={"SHARDLINE_FLAG": "yes"}) is True
    with pytest.raises(errors.InvalidArgument, match="SHARDLINE_GRACE_S='soon' is not a valid float"):
        resolve("grace_s", None, 5.0, environ={"SHARDLINE_GRACE_S": "soon"})


def test_server_config_from_args_and_defaults() -> None:
    import argparse

    parser = argparse.ArgumentParser()
    add_server_arguments(parser, service="worker")
    config = ServerConfig.from_args(parser.parse_args([]), service="worker", environ={})
    assert (config.host, config.port, config.log_level) == ("127.0.0.1", DEFAULT_PORTS["worker"], "INFO")
    config = ServerConfig.from_args(parser.parse_args(["--port", "0", "--log-level", "debug"]),
                                    service="worker", environ={"SHARDLINE_PORT": "9"})
    assert (config.port, config.log_level) == (0, "DEBUG")
    assert DEFAULT_PORTS == {"router": 50051, "worker": 50052, "planner": 50053, "loader": 50054, "telemetry": 50055,
                             "fleet": 50056}
    with pytest.raises(errors.InvalidArgument, match="port must be in"):
        ServerConfig(service="worker", port=70000)


# --- error mapping and graceful stop, on a real in-process server ----------------------------


class CheckpointLayoutError(errors.FailedPrecondition):
    """A subclass needs no table entry of its own."""


_ERRORS: dict[str, Exception] = {
    "InvalidArgument": errors.InvalidArgument("top_p must be in (0, 1], got 0.0"),
    "ResourceExhausted": errors.ResourceExhausted("queue full (64 of 64)"),
    "Unavailable": errors.Unavailable("no healthy replica group"),
    "Unauthenticated": errors.Unauthenticated("missing API key"),
    "NotFound": errors.NotFound("unknown model 'x'"),
    "FailedPrecondition": errors.FailedPrecondition("tp mismatch: expected 2, got 4"),
    "AlreadyExists": errors.AlreadyExists("replica group rg-1 already exists"),
    "CheckpointLayoutError": CheckpointLayoutError("dtype mismatch: expected float32, got bfloat16"),
}
_EXPECTED_CODE = {
    "InvalidArgument": grpc.StatusCode.INVALID_ARGUMENT,
    "ResourceExhausted": grpc.StatusCode.RESOURCE_EXHAUSTED,
    "Unavailable": grpc.StatusCode.UNAVAILABLE,
    "Unauthenticated": grpc.StatusCode.UNAUTHENTICATED,
    "NotFound": grpc.StatusCode.NOT_FOUND,
    "FailedPrecondition": grpc.StatusCode.FAILED_PRECONDITION,
    "AlreadyExists": grpc.StatusCode.ALREADY_EXISTS,
    "CheckpointLayoutError": grpc.StatusCode.FAILED_PRECONDITION,
}


def _raise_named(request: bytes, _context: grpc.ServicerContext) -> bytes:
    name = request.decode()
    if name == "sleep":
        time.sleep(1.0)
        return b"done"
    raise _ERRORS[name]


def _stream_then_raise(request: bytes, _context: grpc.ServicerContext) -> Iterator[bytes]:
    yield b"first token"
    raise _ERRORS[request.decode()]


def _test_binding() -> ServiceBinding:
    identity = {"request_deserializer": None, "response_serializer": None}
    handler = grpc.method_handlers_generic_handler("test.Errors", {
        "Unary": grpc.unary_unary_rpc_method_handler(_raise_named, **identity),
        "Stream": grpc.unary_stream_rpc_method_handler(_stream_then_raise, **identity),
    })
    return ServiceBinding("test.Errors", None, lambda _servicer, server: server.add_generic_rpc_handlers((handler,)))


@pytest.fixture
def error_server() -> Iterator[tuple[grpc.Channel, object]]:
    running = start_server(ServerConfig(service="planner", port=0, grace_s=5), [_test_binding()])
    channel = grpc.insecure_channel(f"127.0.0.1:{running.port}")
    yield channel, running
    channel.close()
    running.stop(0)


def test_every_shardline_error_class_is_in_the_table() -> None:
    assert set(STATUS_FOR_ERROR) == {
        errors.InvalidArgument, errors.ResourceExhausted, errors.Unavailable,
        errors.Unauthenticated, errors.NotFound, errors.FailedPrecondition, errors.AlreadyExists, errors.Unimplemented,
    }


@pytest.mark.parametrize("name", list(_ERRORS))
def test_domain_errors_become_statuses_unary_and_streaming(error_server, name: str) -> None:
    channel, _running = error_server
    with pytest.raises(grpc.RpcError) as caught:
        channel.unary_unary("/test.Errors/Unary")(name.encode(), timeout=5)
    assert (caught.value.code(), caught.value.details()) == (_EXPECTED_CODE[name], str(_ERRORS[name]))

    received: list[bytes] = []
    with pytest.raises(grpc.RpcError) as caught:
        for item in channel.unary_stream("/test.Errors/Stream")(name.encode(), timeout=5):
            received.append(item)
    assert received == [b"first token"]  # what was streamed before the error stays delivered
    assert caught.value.code() == _EXPECTED_CODE[name]


def test_stop_turns_health_not_serving_and_lets_in_flight_rpcs_finish(error_server) -> None:
    channel, running = error_server
    assert _health(channel) == "SERVING" and _health(channel, "test.Errors") == "SERVING"
    future = channel.unary_unary("/test.Errors/Unary").future(b"sleep", timeout=10)
    time.sleep(0.2)  # the call is in the handler now
    stopper = threading.Thread(target=running.stop)
    stopper.start()
    time.sleep(0.1)
    assert future.result() == b"done"
    stopper.join(timeout=10)
    assert not stopper.is_alive()
    assert running.health.Check(health_pb2.HealthCheckRequest(service=""), None).status == (
        health_pb2.HealthCheckResponse.NOT_SERVING
    )


def test_a_service_can_start_not_serving_until_ready() -> None:
    """A worker binds its port first and turns SERVING only once its shards are loaded."""
    running = start_server(ServerConfig(service="worker", port=0), [_test_binding()], start_serving=False)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{running.port}") as channel:
            assert _health(channel) == "NOT_SERVING" and _health(channel, "test.Errors") == "NOT_SERVING"
            running.set_serving(True)
            assert _health(channel) == "SERVING" and _health(channel, "test.Errors") == "SERVING"
    finally:
        running.stop(0)
