"""Protobuf <-> domain conversion for the telemetry service (the only telemetry module besides
server.py and client.py that imports generated code)."""

from __future__ import annotations

from collections.abc import Iterable

from services.common.collective_events import CollectiveEvent
from services.common.group_status import GroupStatus
from services.common.proto import common_pb2, telemetry_pb2
from services.telemetry.rules import Alert, AlertKind
from services.telemetry.windows import WindowSummary

ALERT_KINDS = {
    AlertKind.COLLECTIVE_TIMEOUT: telemetry_pb2.ALERT_KIND_COLLECTIVE_TIMEOUT,
    AlertKind.SLOW_RANK: telemetry_pb2.ALERT_KIND_SLOW_RANK,
    AlertKind.STAGE_LINK_FAILURE: telemetry_pb2.ALERT_KIND_STAGE_LINK_FAILURE,
    AlertKind.STAGE_LINK_FLAP: telemetry_pb2.ALERT_KIND_STAGE_LINK_FLAP,
    AlertKind.SHADOW_DIVERGENCE: telemetry_pb2.ALERT_KIND_SHADOW_DIVERGENCE,
    AlertKind.QUALITY_DRIFT: telemetry_pb2.ALERT_KIND_QUALITY_DRIFT,
    AlertKind.PROVISIONING_FAILED: telemetry_pb2.ALERT_KIND_PROVISIONING_FAILED,
}
KINDS_FROM_PB = {v: k for k, v in ALERT_KINDS.items()}
GROUP_STATUSES = {
    GroupStatus.HEALTHY: common_pb2.REPLICA_GROUP_STATUS_HEALTHY,
    GroupStatus.DEGRADED: common_pb2.REPLICA_GROUP_STATUS_DEGRADED,
    GroupStatus.DRAINING: common_pb2.REPLICA_GROUP_STATUS_DRAINING,
    GroupStatus.UNHEALTHY: common_pb2.REPLICA_GROUP_STATUS_UNHEALTHY,
}
STATUSES_FROM_PB = {v: k for k, v in GROUP_STATUSES.items()}


def event_to_pb(e: CollectiveEvent) -> telemetry_pb2.CollectiveEvent:
    return telemetry_pb2.CollectiveEvent(
        replica_group_id=e.replica_group_id, gpu_id=e.gpu_id, op_type=e.op_type, bytes=e.bytes,
        duration_ms=e.duration_ms, group_size=e.group_size, timestamp_ms=e.timestamp_ms, timed_out=e.timed_out,
        peer_lost=e.peer_lost, seq=e.seq, communicator=e.communicator)


def report_request(events: Iterable[CollectiveEvent], dropped: int = 0) -> telemetry_pb2.ReportRequest:
    return telemetry_pb2.ReportRequest(events=[event_to_pb(e) for e in events], dropped=dropped)


def event_from_pb(pb: telemetry_pb2.CollectiveEvent) -> CollectiveEvent:
    return CollectiveEvent(pb.replica_group_id, pb.gpu_id, pb.op_type, pb.bytes, pb.duration_ms, pb.group_size,
                           pb.timestamp_ms, pb.timed_out, pb.peer_lost, pb.seq, pb.communicator)


def window_to_pb(w: WindowSummary) -> telemetry_pb2.CollectiveWindow:
    return telemetry_pb2.CollectiveWindow(
        replica_group_id=w.replica_group_id, gpu_id=w.gpu_id, op_type=w.op_type, window_start_ms=w.window_start_ms,
        window_end_ms=w.window_end_ms, count=w.count, bytes=w.bytes, p50_ms=w.p50_ms, p95_ms=w.p95_ms,
        p99_ms=w.p99_ms, timeouts=w.timeouts)


def alert_to_pb(a: Alert) -> telemetry_pb2.Alert:
    return telemetry_pb2.Alert(
        kind=ALERT_KINDS[a.kind], replica_group_id=a.replica_group_id, gpu_id=a.gpu_id, op_type=a.op_type,
        new_status=GROUP_STATUSES[a.new_status], message=a.message, timestamp_ms=a.timestamp_ms,
        observed_p99_ms=a.observed_p99_ms, baseline_p99_ms=a.baseline_p99_ms,
        perplexity_delta_pct=a.perplexity_delta_pct, threshold_pct=a.threshold_pct, reference=a.reference)


def alert_from_pb(pb: telemetry_pb2.Alert, now_ms: int) -> Alert:
    """A raised alert as the pipeline keeps it; a quality alert degrades its group unless it
    says otherwise. Raises KeyError for a kind this version does not know."""
    status = STATUSES_FROM_PB.get(pb.new_status, GroupStatus.DEGRADED)
    return Alert(KINDS_FROM_PB[pb.kind], pb.replica_group_id, pb.gpu_id, pb.op_type, status, pb.message,
                 pb.timestamp_ms or now_ms, pb.observed_p99_ms, pb.baseline_p99_ms, pb.perplexity_delta_pct,
                 pb.threshold_pct, pb.reference)
