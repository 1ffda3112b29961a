"""TelemetryService: CollectiveEvent ingest, windowed percentiles and alerts over gRPC.

A thin servicer: protobuf in, a call into :class:`~services.telemetry.pipeline.TelemetryPipeline`
(windows, rules, effects), protobuf out. ``Report`` hands each batch's events to the pipeline as
they are (they carry the CollectiveEvent field names), so ingest converts nothing per event.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from collections.abc import Iterator

import grpc
from opentelemetry.metrics import Observation

from services.common.config import resolve
from services.common.errors import InvalidArgument
from services.common.grpc_server import GrpcServer, ServiceBinding, serve_service
from services.common.health import make_health_store
from services.common.proto import telemetry_pb2, telemetry_pb2_grpc
from services.common.registry import ShardRegistry
from services.telemetry.convert import alert_from_pb, alert_to_pb, window_to_pb
from services.telemetry.effects import GroupStatusEffects
from services.telemetry.observability import add_metrics_arguments, setup_observability
from services.telemetry.otel import MetricsPortError, collective_metrics
from services.telemetry.pipeline import PipelineConfig, TelemetryPipeline
from services.telemetry.rules import AlertKind, RuleConfig
from services.telemetry.windows import WindowConfig

SERVICE = "telemetry"
log = logging.getLogger(__name__)
ALERT_POLL_S = 0.25


class TelemetryServicer(telemetry_pb2_grpc.TelemetryServiceServicer):
    """gRPC face of the telemetry pipeline."""

    def __init__(self, pipeline: TelemetryPipeline) -> None:
        self.pipeline = pipeline

    def Report(self, request_iterator: Iterator[telemetry_pb2.ReportRequest],
               context: grpc.ServicerContext) -> telemetry_pb2.ReportResponse:
        accepted = dropped = 0
        for request in request_iterator:
            accepted += self.pipeline.ingest(request.events, dropped=request.dropped, node_id=request.node_id)
            dropped += request.dropped
        return telemetry_pb2.ReportResponse(accepted=accepted, dropped=dropped)

    def Query(self, request: telemetry_pb2.QueryRequest, context: grpc.ServicerContext) -> telemetry_pb2.QueryResponse:
        windows = self.pipeline.query(replica_group_id=request.replica_group_id, gpu_id=request.gpu_id,
                                      op_type=request.op_type)
        return telemetry_pb2.QueryResponse(windows=[window_to_pb(w) for w in windows],
                                           dropped_total=self.pipeline.dropped_total)

    def Alerts(self, request: telemetry_pb2.AlertsRequest,
               context: grpc.ServicerContext) -> Iterator[telemetry_pb2.Alert]:
        subscription = self.pipeline.subscribe(request.replica_group_id)
        context.add_callback(subscription.close)
        try:
            while context.is_active() and not subscription.closed:
                alert = subscription.get(ALERT_POLL_S)
                if alert is not None:
                    yield alert_to_pb(alert)
        finally:
            subscription.close()

    def RaiseAlert(self, request: telemetry_pb2.RaiseAlertRequest,
                   context: grpc.ServicerContext) -> telemetry_pb2.RaiseAlertResponse:
        try:
            alert = alert_from_pb(request.alert, int(time.time() * 1000))
            self.pipeline.raise_alert(alert)
        except KeyError:
            raise InvalidArgument(f"unknown alert kind {request.alert.kind}") from None
        except ValueError as exc:
            raise InvalidArgument(str(exc)) from None
        return telemetry_pb2.RaiseAlertResponse()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Telemetry-specific flags (the common server flags are added by the caller)."""
    group = parser.add_argument_group("telemetry")
    group.add_argument("--redis-url", default=None,
                       help="health store the alerts write to (env SHARDLINE_REDIS_URL; default: none)")
    group.add_argument("--registry-url", default=None,
                       help="shard registry whose replica_groups.status alerts update "
                            "(env SHARDLINE_REGISTRY_URL; default: none)")
    group.add_argument("--window-s", type=float, default=None,
                       help="window length in seconds (env SHARDLINE_TELEMETRY_WINDOW_S; default 10)")
    group.add_argument("--retain-windows", type=int, default=None, help="windows kept per series (default 6)")
    group.add_argument("--slow-k", type=float, default=None,
                       help="a rank is slow above k x the group's all-reduce p99 baseline (default 3)")
    group.add_argument("--sustain-windows", type=int, default=None,
                       help="consecutive windows a rank must be slow before the alert (default 3)")
    group.add_argument("--baseline-windows", type=int, default=None,
                       help="windows the group's baseline is learned over (default 3)")
    group.add_argument("--min-events", type=int, default=None,
                       help="all-reduces a rank needs in a window for its p99 to count (default 10)")
    group.add_argument("--min-excess-ms", type=float, default=None,
                       help="a slow p99 must also exceed the baseline by this many ms (default 0.5)")
    add_metrics_arguments(group)


def pipeline_config(args: argparse.Namespace) -> PipelineConfig:
    window_s = resolve("telemetry_window_s", args.window_s, 10.0)
    rules = RuleConfig()
    return PipelineConfig(
        windows=WindowConfig(window_s=window_s, retain_windows=args.retain_windows or 6),
        rules=RuleConfig(slow_k=args.slow_k or rules.slow_k,
                         sustain_windows=args.sustain_windows or rules.sustain_windows,
                         baseline_windows=args.baseline_windows or rules.baseline_windows,
                         min_events=args.min_events or rules.min_events,
                         min_excess_ms=args.min_excess_ms if args.min_excess_ms is not None else rules.min_excess_ms),
        close_grace_s=min(1.0, max(0.3, window_s / 4)))


def build_pipeline(args: argparse.Namespace) -> TelemetryPipeline:
    redis_url = resolve("redis_url", args.redis_url, "") or None
    registry_url = resolve("registry_url", args.registry_url, "") or None
    effects = None
    if redis_url or registry_url:
        health = make_health_store(redis_url) if redis_url else None
        registry = ShardRegistry(registry_url, migrate_schema=True) if registry_url else None
        effects = GroupStatusEffects(health=health, registry=registry)
    return TelemetryPipeline(pipeline_config(args), effects=effects)


def serve(args: argparse.Namespace) -> int:
    pipeline = build_pipeline(args)
    servicer = TelemetryServicer(pipeline)
    # /metrics is up before health says SERVING: whoever waits for SERVING can scrape at once
    try:
        metrics = setup_observability(args, SERVICE)
    except MetricsPortError as exc:
        print(f"shardline serve telemetry: {exc}", file=sys.stderr)
        return 1
    start_ns = time.time_ns()
    metrics.add_producer(lambda now_ns: collective_metrics(pipeline.totals(), start_ns=start_ns, now_ns=now_ns))
    metrics.meter.create_observable_counter(
        "shardline.telemetry.sender_dropped", unit="{event}",
        description="Events the ranks' shippers reported dropping",
        callbacks=[lambda _o: [_observation(pipeline.dropped_total)]])
    metrics.meter.create_observable_counter(
        "shardline.telemetry.alerts", unit="{alert}", description="Alerts raised, by kind (collective_timeout, "
        "slow_rank, stage_link_failure, stage_link_flap, shadow_divergence, quality_drift, provisioning_failed)",
        callbacks=[lambda _o: [Observation(pipeline.alerts_by_kind.get(kind.value, 0), {"kind": kind.value})
                               for kind in AlertKind]])

    def on_started(server: GrpcServer) -> None:
        pipeline.start()
        log.info("telemetry windows of %g s; /metrics port %s", pipeline.config.windows.window_s, metrics.metrics_port)

    def on_stopping(server: GrpcServer) -> None:
        pipeline.close()

    binding = ServiceBinding(
        full_name=telemetry_pb2.DESCRIPTOR.services_by_name["TelemetryService"].full_name,
        servicer=servicer, add_to_server=telemetry_pb2_grpc.add_TelemetryServiceServicer_to_server)
    return serve_service(args, service=SERVICE, bindings=lambda: [binding], on_started=on_started,
                         on_stopping=on_stopping)


def _observation(value: int) -> Observation:
    return Observation(value)
