"""OpenTelemetry export: the collective metrics over OTLP, and Prometheus federation into a
router-style registry."""

from __future__ import annotations

import threading
import time
from concurrent import futures

import grpc
import pytest
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2, metrics_service_pb2_grpc
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from services.common.collective_events import CollectiveEvent
from services.telemetry.client import ShipperConfig, TelemetryShipper
from services.telemetry.federation import UpstreamMetricsCollector
from services.telemetry.otel import Metrics, MetricsOptions, collective_metrics, register_engine_gauges
from services.telemetry.pipeline import TelemetryPipeline
from tests.stack import free_port
from tests.telemetry.procs import wait_until


class MetricsCollector(metrics_service_pb2_grpc.MetricsServiceServicer):
    def __init__(self) -> None:
        self.requests: list = []
        self.lock = threading.Lock()

    def Export(self, request, context):
        with self.lock:
            self.requests.append(request)
        return metrics_service_pb2.ExportMetricsServiceResponse()

    def metrics(self) -> dict:
        with self.lock:
            return {m.name: m for r in self.requests for rm in r.resource_metrics for sm in rm.scope_metrics
                    for m in sm.metrics}


@pytest.fixture
def otlp_metrics():
    collector = MetricsCollector()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    metrics_service_pb2_grpc.add_MetricsServiceServicer_to_server(collector, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield collector, f"127.0.0.1:{port}"
    server.stop(None)


def test_collective_histogram_and_gauges_are_exported_over_otlp(otlp_metrics):
    collector, endpoint = otlp_metrics
    pipeline = TelemetryPipeline()
    now = int(time.time() * 1e3)
    pipeline.ingest([CollectiveEvent("rg-otlp", f"rg-otlp:pp0-tp{r}", "all_reduce", 4096, d, 2, now, d > 1000)
                     for r in range(2) for d in (0.04, 0.3, 3.0, 2000.0)])
    metrics = Metrics(MetricsOptions("test", otlp_endpoint=endpoint, export_interval_s=0.2))
    try:
        metrics.add_producer(lambda now_ns: collective_metrics(pipeline.totals(), start_ns=1, now_ns=now_ns))
        register_engine_gauges(metrics.meter, "rg-otlp", lambda: {"kv_bytes_used": 25, "kv_bytes_capacity": 100,
                                                                  "running": 3, "waiting": 1})
        got = wait_until(lambda: {"shardline.collective.duration", "shardline.kv_cache.usage_ratio"}
                         <= set(collector.metrics()), 10)
        assert got, sorted(collector.metrics())
        exported = collector.metrics()
        points = exported["shardline.collective.duration"].histogram.data_points
        attrs = [{a.key: (a.value.string_value or a.value.int_value) for a in p.attributes} for p in points]
        assert attrs == [{"replica_group_id": "rg-otlp", "gpu_id": f"rg-otlp:pp0-tp{r}", "op_type": "all_reduce",
                          "group_size": 2} for r in range(2)]  # one series per rank
        assert [p.count for p in points] == [4, 4] and exported["shardline.collective.duration"].unit == "s"
        # 40 µs, 0.3 ms, 3 ms and 2 s per rank: buckets le 50 µs, 0.5 ms, 5 ms, 2.5 s
        for point in points:
            bounds = list(point.explicit_bounds)
            assert point.bucket_counts[bounds.index(0.00005)] == 1 and point.bucket_counts[bounds.index(2.5)] == 1
        timeouts = exported["shardline.collective.timeouts"].sum.data_points
        assert [t.as_int for t in timeouts] == [1, 1] and exported["shardline.collective.timeouts"].sum.is_monotonic
        (kv,) = exported["shardline.kv_cache.usage_ratio"].gauge.data_points
        assert kv.as_double == 0.25
        (running,) = exported["shardline.requests.running"].gauge.data_points
        assert running.as_int == 3 or running.as_double == 3
    finally:
        metrics.shutdown()
        pipeline.close()


def test_router_registry_federates_the_telemetry_metrics(telemetry):
    shipper = TelemetryShipper(ShipperConfig(telemetry.address))
    now = int(time.time() * 1e3)
    for i in range(30):
        shipper.record(CollectiveEvent("rg-fed", "rg-fed:pp0-tp0", "recv" if i % 3 else "send", 64, 0.2, 2, now,
                                       False))
    shipper.close(timeout_s=10)
    registry = CollectorRegistry()  # stands in for the router's default registry
    dead = f"http://127.0.0.1:{free_port()}/metrics"
    registry.register(UpstreamMetricsCollector([telemetry.metrics_url, dead], timeout_s=1.0))
    text = generate_latest(registry).decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    counts = {s.labels["op_type"]: s.value for s in families["shardline_collective_duration_seconds"].samples
              if s.name.endswith("_count") and s.labels["replica_group_id"] == "rg-fed"}
    assert counts == {"send": 10, "recv": 20}
    up = {s.labels["upstream"]: s.value for s in families["shardline_metrics_upstream_up"].samples}
    assert up == {telemetry.metrics_url: 1.0, dead: 0.0}
    assert not any(name.startswith(("python_", "process_")) for name in families)


def test_families_the_router_exports_itself_are_not_pulled_in(telemetry):
    from prometheus_client import Gauge

    from services.telemetry.federation import register_upstreams

    registry = CollectorRegistry()
    Gauge("shardline_telemetry_alerts_total", "the router's own family of that name", registry=registry)
    register_upstreams([telemetry.metrics_url], registry=registry)
    text = generate_latest(registry).decode()
    assert text.count("# TYPE shardline_telemetry_alerts_total ") == 1
    assert "# TYPE shardline_telemetry_sender_dropped counter" in text or \
        "# TYPE shardline_telemetry_sender_dropped_total counter" in text
