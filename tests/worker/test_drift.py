"""Per-group drift on two serving tiny groups, one started with SHARDLINE_WEIGHT_NOISE (a planted
faulty shard): `shardline gate --group` passes the clean one and fails the noisy one, recording
both; `shardline drift` on a schedule raises ALERT_KIND_QUALITY_DRIFT naming only the noisy one
through a real telemetry process, which marks it degraded; a dead group or a telemetry that is
down does not stop the monitor."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from services.cli import main
from services.common.config import child_environ
from services.common.proto import telemetry_pb2
from services.common.registry import ShardRegistry, registry_group_id
from tests.cli import run_cli
from tests.router.processes import spawn, stop, wait_serving
from tests.stack import free_port
from tests.telemetry.procs import alerts_reader, start_service, wait_until

REPO = Path(__file__).resolve().parents[2]
NOISE = "layer=1,std=0.5,seed=0"
GOLDEN = ("--chunks", "4", "--chunk-tokens", "64")


@dataclass
class Groups:
    registry: str
    logs: Path


@pytest.fixture(scope="module")
def groups(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Groups]:
    """rg-clean and rg-noisy: tiny float32 workers registered in one registry."""
    logs = tmp_path_factory.mktemp("drift")
    registry = f"sqlite:///{logs / 'registry.db'}"
    ShardRegistry(registry, migrate_schema=True).close()  # once, before two workers start together
    started = []
    try:
        for name, env in (("rg-clean", child_environ()), ("rg-noisy", child_environ(SHARDLINE_WEIGHT_NOISE=NOISE))):
            port = free_port()
            proc = spawn(["serve", "worker", "--port", str(port), "--model", str(tiny_model_dir), "--kv-cache-gb",
                          "0.02", "--replica-group-id", name, "--registry-url", registry], logs / f"{name}.log",
                         env=env)
            started.append((proc, f"127.0.0.1:{port}", logs / f"{name}.log"))
        for proc, address, log in started:
            wait_serving(proc, address, log)
        yield Groups(registry, logs)
    finally:
        for proc, _, _ in started:
            stop(proc)
    assert "perturbed model.layers.1.mlp.down_proj.weight" in (logs / "rg-noisy.log").read_text()
    assert "perturbed" not in (logs / "rg-clean.log").read_text()


def shardline(*argv: str, timeout_s: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "services.cli", *argv], cwd=REPO, env=child_environ(),
                          capture_output=True, text=True, timeout=timeout_s)


@pytest.mark.slow
def test_gate_group_passes_the_clean_group_fails_the_noisy_one_and_keeps_history(
        tiny_model_dir: Path, groups: Groups, capsys: pytest.CaptureFixture) -> None:
    reg = ("--registry-url", groups.registry)
    clean = run_cli("gate", "--model", str(tiny_model_dir), "--group", "rg-clean", *GOLDEN, *reg, "--json")
    assert clean.returncode == 0, clean.stdout + clean.stderr
    verdict = json.loads(clean.stdout)
    assert verdict["candidate"] == "group=rg-clean" and verdict["reference"] == "dtype=float32"
    assert verdict["passed"] and verdict["max_abs_logprob_delta"] < 1e-4

    # by UUID: recorded under the group's name all the same
    noisy = run_cli("gate", "--model", str(tiny_model_dir), "--group", str(registry_group_id("rg-noisy")),
                    *GOLDEN, *reg)
    assert noisy.returncode == 1, noisy.stdout + noisy.stderr
    assert "group=rg-noisy" in noisy.stdout and "verdict: FAIL" in noisy.stdout
    assert "top-1 agreement" in noisy.stdout and "is below 0.97" in noisy.stdout

    # the listing and the refusals run no rank: in this process
    assert main(["gate", "--group", "rg-noisy", "--history", *reg, "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["results"]
    assert [(r["candidate"], r["passed"], r["chunks"]) for r in rows] == [("group=rg-noisy", False, 4)]
    assert main(["gate", "--group", "rg-clean", "--history", *reg]) == 0
    table = capsys.readouterr().out
    assert "drift history of group rg-clean: 1 verdict(s)" in table and "PASS" in table

    assert main(["gate", "--group", "rg-clean", *reg]) == 2
    assert "needs --model DIR" in capsys.readouterr().err
    assert main(["gate", "--model", str(tiny_model_dir), "--group", "rg-clean", "--candidate", "dtype=float32",
                 *reg]) == 2
    assert "not both" in capsys.readouterr().err
    assert main(["gate", "--model", str(tiny_model_dir), "--group", "rg-nobody", *GOLDEN, *reg]) == 2
    assert "no such replica group" in capsys.readouterr().err


@pytest.mark.slow
def test_drift_monitor_alerts_the_noisy_group_only(tiny_model_dir: Path, groups: Groups) -> None:
    with ShardRegistry(groups.registry) as registry:
        # a group in rotation whose worker is gone: logged each round, never stops the monitor
        gone = registry.create_replica_group("tiny", 1, 1, "float32", 1 << 20, name="rg-gone",
                                             endpoint=f"127.0.0.1:{free_port()}")
        registry.set_status(gone.replica_group_id, "healthy", by="operator")
    telemetry = start_service("telemetry", groups.logs / "telemetry.log", "--registry-url", groups.registry,
                              metrics=False)
    alerts, _, channel = alerts_reader(telemetry.address, "")
    log = groups.logs / "drift.log"
    monitor = spawn(["drift", "--every", "2", "--model", str(tiny_model_dir), "--registry-url", groups.registry,
                     "--telemetry", telemetry.address, *GOLDEN], log)
    try:
        started = time.monotonic()
        drift = wait_until(lambda: [a for a in alerts if a.kind == telemetry_pb2.ALERT_KIND_QUALITY_DRIFT], 20)
        assert drift, log.read_text()
        assert time.monotonic() - started < 20
        alert = drift[0]
        assert alert.replica_group_id == "rg-noisy" and alert.reference == "dtype=float32"
        assert alert.threshold_pct == pytest.approx(0.5) and "top-1 agreement" in alert.message
        assert f"{alert.perplexity_delta_pct:+.3f} %" in alert.message
        with ShardRegistry(groups.registry) as registry:
            assert wait_until(lambda: registry.get_group(registry_group_id("rg-noisy")).status == "degraded", 10)
            # a second round: the degraded group is still checked, and fails again
            assert wait_until(lambda: len([r for r in registry.list_gate_results(candidate="group=rg-noisy")
                                           if r.chunks == 4 and not r.passed]) >= 3, 15), log.read_text()
            assert registry.get_group(registry_group_id("rg-clean")).status == "healthy"
            assert all(r.passed for r in registry.list_gate_results(candidate="group=rg-clean"))
        assert {a.replica_group_id for a in alerts if a.kind == telemetry_pb2.ALERT_KIND_QUALITY_DRIFT} == {"rg-noisy"}
    finally:
        channel.close()
        code = stop(monitor)
        telemetry.stop()
    text = log.read_text()
    assert code == 0 and "Traceback" not in text, text
    assert "group rg-clean: PASS" in text and "group rg-noisy: FAIL" in text
    assert f"group {gone.replica_group_id} not checked: Unavailable" in text

    # telemetry down: the verdict is still recorded and the round finishes
    down = shardline("drift", "--every", "1", "--rounds", "1", "--model", str(tiny_model_dir), "--group", "rg-noisy",
                     "--registry-url", groups.registry, "--telemetry", f"127.0.0.1:{free_port()}", *GOLDEN)
    assert down.returncode == 0, down.stderr
    assert "group rg-noisy drifted, but telemetry" in down.stderr and "UNAVAILABLE" in down.stderr


def test_up_starts_the_drift_monitor_only_when_asked(tmp_path: Path) -> None:
    from services.cli import build_parser
    from services.cli.up import drift_argv

    model, registry = tmp_path / "model", f"sqlite:///{tmp_path / 'r.db'}"
    off = build_parser("up").parse_args(["up"])
    assert drift_argv(off, model, registry, "127.0.0.1:50055") is None
    on = build_parser("up").parse_args(["up", "--drift-every", "300"])
    argv = drift_argv(on, model, registry, "127.0.0.1:50055")
    assert argv[:3] == [sys.executable, "-m", "services.cli"]
    args = build_parser("drift").parse_args(argv[3:])
    assert (args.every, args.model, args.registry_url, args.telemetry) == (300, str(model), registry, "127.0.0.1:50055")
    assert args.group is None and args.chunks == 8 and args.reference == "dtype=float32"
