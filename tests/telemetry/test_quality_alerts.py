"""TelemetryService.RaiseAlert: a quality check outside telemetry (shadow traffic, the drift check)
hands it an alert; subscribers get it with its figures and the named group is degraded in the
registry. The collective kinds stay the rules' own."""

from __future__ import annotations

import uuid

import grpc
import pytest

from services.common.group_status import GroupStatus
from services.common.proto import telemetry_pb2
from services.common.registry import ShardRegistry, registry_group_id
from services.telemetry.client import raise_alert
from services.telemetry.rules import Alert, AlertKind
from tests.telemetry.procs import alerts_reader, start_service, telemetry_stub, wait_until
from tests.telemetry.test_rules import register_group


def drift(group: str) -> Alert:
    return Alert(AlertKind.QUALITY_DRIFT, group, "", "", GroupStatus.DEGRADED,
                 f"{group}: golden-set perplexity +2.40 % vs its baseline (threshold 0.5 %)", 0,
                 perplexity_delta_pct=2.4, threshold_pct=0.5, reference="baseline")


def test_a_raised_drift_alert_reaches_subscribers_and_degrades_the_group(tmp_path):
    registry_url = f"sqlite:///{tmp_path / 'registry.db'}"
    with ShardRegistry(registry_url, migrate_schema=True) as registry:
        group = f"rg-{uuid.uuid4().hex[:8]}"
        gid = register_group(registry, group)
        telemetry = start_service("telemetry", tmp_path / "telemetry.log", "--registry-url", registry_url,
                                  metrics=False)
        alerts, _, channel = alerts_reader(telemetry.address, group)
        try:
            raise_alert(telemetry.address, drift(group))
            got = wait_until(lambda: alerts, 10)
            assert got, telemetry.log.read_text()[-2000:]
            alert = got[0]
            assert alert.kind == telemetry_pb2.ALERT_KIND_QUALITY_DRIFT and alert.replica_group_id == group
            assert alert.perplexity_delta_pct == pytest.approx(2.4) and alert.threshold_pct == pytest.approx(0.5)
            assert alert.reference == "baseline" and "+2.40 %" in alert.message and alert.timestamp_ms > 0
            assert wait_until(lambda: registry.get_group(gid).status == "degraded", 10)
            assert registry.get_group(registry_group_id(group)).status == "degraded"
        finally:
            channel.close()
            assert telemetry.stop() == 0


def test_collective_kinds_and_unnamed_groups_are_refused(telemetry):
    channel, stub = telemetry_stub(telemetry.address)
    with channel:
        for alert in (telemetry_pb2.Alert(kind=telemetry_pb2.ALERT_KIND_SLOW_RANK, replica_group_id="rg-x"),
                      telemetry_pb2.Alert(kind=telemetry_pb2.ALERT_KIND_QUALITY_DRIFT),
                      telemetry_pb2.Alert(kind=telemetry_pb2.ALERT_KIND_UNSPECIFIED, replica_group_id="rg-x")):
            with pytest.raises(grpc.RpcError) as err:
                stub.RaiseAlert(telemetry_pb2.RaiseAlertRequest(alert=alert), timeout=5)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, alert
