"""docker-compose.yml is accepted by `docker-compose config` and describes the whole stack:
PostgreSQL, Redis and the five services, each health-checked and started with the same entry
point the tests run (`shardline serve <name>`). No Docker engine is needed (or used)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from services.common.config import DEFAULT_PORTS

REPO = Path(__file__).resolve().parents[1]
SHARDLINE_SERVICES = ("planner", "loader", "worker", "router", "telemetry")
PP_NODES = ("worker-pp-node0", "worker-pp-node1")  # one replica group, a pipeline stage per container


@pytest.fixture(scope="module")
def compose() -> dict:
    binary = shutil.which("docker-compose")
    if binary is None:
        pytest.fail("docker-compose is not installed: `make test` installs it "
                    "(Debian package docker-compose, via `make system-deps`)")
    result = subprocess.run([binary, "-f", str(REPO / "docker-compose.yml"), "config"],
                            cwd=REPO, capture_output=True, text=True, timeout=120,
                            # The file's ${SHARDLINE_*:-default}s must resolve to their defaults;
                            # the internal token has none, on purpose.
                            env={**{k: v for k, v in os.environ.items() if not k.startswith("SHARDLINE_")},
                                 "SHARDLINE_INTERNAL_TOKEN": "compose-test-token"})
    assert result.returncode == 0, f"docker-compose config rejected the file:\n{result.stderr}"
    return yaml.safe_load(result.stdout)


def test_the_internal_token_is_required_and_reaches_every_service(compose: dict) -> None:
    for name in SHARDLINE_SERVICES:
        assert compose["services"][name]["environment"]["SHARDLINE_INTERNAL_TOKEN"] == "compose-test-token"
    result = subprocess.run([shutil.which("docker-compose"), "-f", str(REPO / "docker-compose.yml"), "config"],
                            cwd=REPO, capture_output=True, text=True, timeout=120,
                            env={k: v for k, v in os.environ.items() if not k.startswith("SHARDLINE_")})
    assert result.returncode != 0 and "SHARDLINE_INTERNAL_TOKEN" in result.stderr


def test_all_seven_services_exist(compose: dict) -> None:
    assert set(compose["services"]) == {"postgres", "redis", *SHARDLINE_SERVICES, *PP_NODES}
    assert compose["services"]["postgres"]["image"] == "postgres:15"
    assert compose["services"]["redis"]["image"] == "redis:7"


@pytest.mark.parametrize("name", SHARDLINE_SERVICES)
def test_shardline_service_runs_serve_and_is_health_checked(compose: dict, name: str) -> None:
    service = compose["services"][name]
    command = service["command"]
    assert command[:2] == ["serve", name]
    port = str(DEFAULT_PORTS[name])
    assert command[command.index("--port") + 1] == port
    assert service["build"]["dockerfile"] == "deploy/Dockerfile"
    check = service["healthcheck"]["test"]
    assert check[0] == "CMD" and check[1:] == ["python", "-m", "services.common.healthcheck", "--port", port]
    env = service["environment"]
    assert env["SHARDLINE_REGISTRY_URL"].startswith("postgresql+psycopg://")
    assert env["SHARDLINE_REDIS_URL"] == "redis://redis:6379/0"
    assert env["SHARDLINE_HOST"] == "0.0.0.0"  # reachable by the other containers
    for dependency, condition in service["depends_on"].items():
        assert condition == {"condition": "service_healthy"}, dependency
        assert "healthcheck" in compose["services"][dependency]


def test_datastores_are_health_checked_and_only_the_router_is_published(compose: dict) -> None:
    for name in ("postgres", "redis"):
        assert compose["services"][name]["healthcheck"]["test"]
    published = {name for name, svc in compose["services"].items() if svc.get("ports")}
    assert published == {"router"}
    for port in compose["services"]["router"]["ports"]:
        # docker-compose 1.x prints "127.0.0.1:50051:50051/tcp"; Compose v2 prints a mapping.
        host_ip = port.get("host_ip") if isinstance(port, dict) else str(port).split(":")[0]
        assert host_ip == "127.0.0.1", port


def test_dockerfile_entrypoint_and_codegen_step() -> None:
    dockerfile = (REPO / "deploy" / "Dockerfile").read_text()
    assert dockerfile.startswith("#") and "FROM python:3.11-slim" in dockerfile
    assert "-c constraints.txt" in dockerfile
    assert "python -m services.common.protogen" in dockerfile
    assert 'ENTRYPOINT ["shardline"]' in dockerfile


def test_a_two_node_group_meets_at_node_0_and_the_router_dials_its_driver(compose: dict) -> None:
    nodes = [compose["services"][name] for name in PP_NODES]
    for rank, node in enumerate(nodes):
        command = node["command"]
        assert command[:2] == ["serve", "worker"]
        flags = dict(zip(command[2::2], command[3::2]))
        assert (flags["--pp"], flags["--nnodes"], flags["--node-rank"]) == ("2", "2", str(rank))
        assert flags["--rdzv-endpoint"] == "worker-pp-node0:29500"
    assert "healthcheck" in nodes[0] and "healthcheck" not in nodes[1]  # only the driver serves gRPC
    assert "--advertise-address" in nodes[0]["command"] and "--advertise-address" not in nodes[1]["command"]
    router = compose["services"]["router"]["command"]
    assert [router[i + 1] for i, a in enumerate(router) if a == "--worker"] == ["worker:50052",
                                                                                 "worker-pp-node0:50052"]
