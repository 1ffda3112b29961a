"""A fleet whose checkpoint fails verification: every attempt ends ``provisioning -> dead`` with the
loader's checksum error as the reason, each failure pages (a telemetry alert), attempts back off,
and ``fleet status`` says why."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from bench._fleet_stack import REPO, FleetStack, fleet_spec
from services.common.proto import telemetry_pb2
from tests.telemetry.procs import alerts_reader, start_service


def test_a_corrupt_shard_leaves_dead_groups_with_the_checksum_error(tiny_model_dir: Path, tmp_path: Path) -> None:
    checkpoint = tmp_path / "checkpoint"
    subprocess.run([sys.executable, "-m", "services.cli", "shard", "--model", str(tiny_model_dir), "--tp", "1",
                    "--pp", "1", "--out", str(checkpoint)], cwd=REPO, check=True, capture_output=True, timeout=120)
    shard = checkpoint / "model-tp00-pp00.safetensors"
    data = bytearray(shard.read_bytes())
    data[-100] ^= 0xFF  # one flipped bit pattern in the last tensor: the header still parses
    shard.write_bytes(data)
    spec = fleet_spec("corrupt", tiny_model_dir, replicas=1, dtype="float32")
    spec["replica_group"]["checkpoint"] = {"manifest_uri": str(checkpoint / "manifest.json")}
    telemetry = start_service("telemetry", tmp_path / "telemetry.log", metrics=False)
    alerts, _, channel = alerts_reader(telemetry.address, "")
    stack = FleetStack(tmp_path, tiny_model_dir, "corrupt", f"sqlite:///{tmp_path / 'registry.db'}",
                       telemetry=telemetry.address)

    def dead() -> list[dict]:
        return [g for g in stack.status()["groups"] if g["status"] == "dead"]

    try:
        stack.apply(spec)
        stack.start_controller()
        stack.wait(lambda: len(dead()) >= 2, 90, "two failed attempts")
        stack.wait(lambda: len(alerts) >= 2, 10, "two pages")
    finally:
        stack.close()
        channel.close()
        telemetry.stop()
    failed = {g["id"]: g["reason"] for g in dead()}
    for alert in alerts[:2]:
        assert alert.kind == telemetry_pb2.ALERT_KIND_PROVISIONING_FAILED, alert
        assert alert.replica_group_id in failed and failed[alert.replica_group_id] in alert.message
        assert "ShardChecksumError" in alert.message and "manifest.json" in alert.message
    for group in dead():
        assert "ShardChecksumError" in group["reason"] and "manifest says" in group["reason"], group
        assert group["checkpoint"].endswith("manifest.json") and group["revision"] == 1
    assert not [g for g in stack.status()["groups"] if g["status"] == "healthy"]
    events = [e for _, e in stack.events()]
    assert sum(e.startswith("dead ") for e in events) >= 2 and "next attempt in" in stack.log_tail(200)
