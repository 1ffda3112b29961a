"""OpenTelemetry metrics for every shardline process: OTLP export and a Prometheus ``/metrics``.

``configure_metrics`` sets up this process's MeterProvider once: a Prometheus reader registered
in ``prometheus_client``'s default registry (served on ``--metrics-port``, and scraped into the
router's own ``/metrics`` by :mod:`services.telemetry.federation`), and an OTLP exporter when an
endpoint is configured (``--otlp-endpoint``, ``SHARDLINE_OTLP_ENDPOINT`` or the standard
``OTEL_EXPORTER_OTLP_ENDPOINT``).

Collective metrics are pre-aggregated. The telemetry service ingests tens of thousands of
events a second and the SDK's ``Histogram.record`` costs microseconds per call, so instead of
recording each event the service keeps cumulative bucket counts per series as it windows them
(:class:`services.telemetry.windows.SeriesTotals`), and a *producer* turns those into SDK
metric points at collection time. The bridged readers below add the producers' metrics to what
the SDK collected, so both the Prometheus and the OTLP paths carry them, as the SDK's own data
model (``Histogram`` with explicit bounds, monotonic ``Sum``s, cumulative temporality):

- ``shardline.collective.duration`` (s, histogram) -> ``shardline_collective_duration_seconds``
- ``shardline.collective.bytes`` (By, sum) -> ``shardline_collective_bytes_total``
- ``shardline.collective.timeouts`` (sum) -> ``shardline_collective_timeouts_total``

each with attributes ``replica_group_id``, ``gpu_id`` (the rank), ``op_type``, ``group_size``. Worker gauges use the
SDK's observable instruments directly: ``shardline.kv_cache.usage_ratio`` ->
``shardline_kv_cache_usage_ratio``, ``shardline.requests.running`` / ``.waiting``.
"""

from __future__ import annotations

import logging
import os
import ssl
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from opentelemetry.metrics import CallbackOptions, Meter, Observation
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import (
    AggregationTemporality,
    Histogram,
    HistogramDataPoint,
    InMemoryMetricReader,
    Metric,
    MetricReader,
    MetricsData,
    NumberDataPoint,
    PeriodicExportingMetricReader,
    ResourceMetrics,
    ScopeMetrics,
    Sum,
)
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.util.instrumentation import InstrumentationScope

from services.common.bearer_auth import BearerCheck
from services.common.metrics_http import MetricsHttpServer
from services.telemetry.windows import DURATION_BOUNDS_S, SeriesTotals

log = logging.getLogger(__name__)

SCOPE = InstrumentationScope("shardline")
Producer = Callable[[int], list[Metric]]  # now (ns) -> metrics


def otlp_endpoint_from_env() -> str | None:
    return os.environ.get("SHARDLINE_OTLP_ENDPOINT") or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or None


@dataclass(frozen=True)
class MetricsOptions:
    service: str
    metrics_port: int | None = None  # None: no /metrics endpoint; 0: any free port
    metrics_host: str = "127.0.0.1"
    otlp_endpoint: str | None = None
    export_interval_s: float = 10.0
    metrics_auth: BearerCheck | None = None  # --metrics-auth: the internal token opens /metrics
    ssl_context: ssl.SSLContext | None = None  # the process's TLS certificate, for an https /metrics


class MetricsPortError(OSError):
    """The ``--metrics-port`` could not be bound."""


class _ProducerMixin:
    """Adds the producers' metrics to what the SDK collected, then hands on to the real reader."""

    _producers: Sequence[Producer] = ()
    _resource: Resource = Resource.get_empty()

    def _receive_metrics(self, metrics_data: MetricsData | None, timeout_millis: float = 10_000, **kwargs) -> None:
        extra = [m for producer in list(self._producers) for m in _safe(producer)]
        if extra:
            scope = ScopeMetrics(scope=SCOPE, metrics=extra, schema_url="")
            if metrics_data is None or not metrics_data.resource_metrics:
                metrics_data = MetricsData([ResourceMetrics(resource=self._resource, scope_metrics=[scope],
                                                            schema_url="")])
            else:
                # into the SDK's own "shardline" scope if there is one: exporters key scopes by name
                # and would keep only one of two with the same name
                first = metrics_data.resource_metrics[0]
                scopes = list(first.scope_metrics)
                same = [k for k, sm in enumerate(scopes) if sm.scope.name == SCOPE.name]
                if same:
                    sm = scopes[same[0]]
                    scopes[same[0]] = ScopeMetrics(scope=sm.scope, metrics=[*sm.metrics, *extra],
                                                   schema_url=sm.schema_url)
                else:
                    scopes.append(scope)
                merged = ResourceMetrics(resource=first.resource, scope_metrics=scopes, schema_url=first.schema_url)
                metrics_data = MetricsData([merged, *metrics_data.resource_metrics[1:]])
        super()._receive_metrics(metrics_data, timeout_millis=timeout_millis, **kwargs)  # type: ignore[misc]


def _safe(producer: Producer) -> list[Metric]:
    try:
        return producer(time.time_ns())
    except Exception:  # a broken producer must not break the scrape
        log.exception("metrics producer failed")
        return []


def _bridged(reader_cls: type[MetricReader]) -> type[MetricReader]:
    return type(f"Bridged{reader_cls.__name__}", (_ProducerMixin, reader_cls), {})


class Metrics:
    """This process's meter, its readers and the producers they include."""

    def __init__(self, options: MetricsOptions, *, extra_readers: Sequence[MetricReader] = ()) -> None:
        self.options = options
        self.resource = Resource.create({"service.name": f"shardline-{options.service}"})
        self.producers: list[Producer] = []
        readers: list[MetricReader] = []
        self.metrics_port: int | None = None
        self._http = None
        if options.metrics_port is not None:
            # deferred: an exporter only when one is configured
            from opentelemetry.exporter.prometheus import PrometheusMetricReader

            readers.append(self._reader(PrometheusMetricReader, disable_target_info=True))
        if options.otlp_endpoint:
            # deferred: an exporter only when one is configured
            from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter

            exporter = OTLPMetricExporter(endpoint=options.otlp_endpoint, insecure=True)
            readers.append(self._reader(PeriodicExportingMetricReader, exporter,
                                        export_interval_millis=options.export_interval_s * 1e3))
        for reader in extra_readers:
            self._attach(reader)
            readers.append(reader)
        self.provider = MeterProvider(metric_readers=readers, resource=self.resource)
        self.meter: Meter = self.provider.get_meter("shardline")
        if options.metrics_port is not None:
            try:
                self._http = MetricsHttpServer(options.metrics_port, options.metrics_host, auth=options.metrics_auth,
                                               ssl_context=options.ssl_context)
            except OSError as exc:
                self.provider.shutdown()
                raise MetricsPortError(f"cannot serve /metrics on {options.metrics_host}:{options.metrics_port} "
                                       f"for {options.service}: {exc}") from exc
            self.metrics_port = self._http.server_port
            log.info("%s: Prometheus /metrics on %s://%s:%d/metrics", options.service, self._http.scheme,
                     options.metrics_host, self.metrics_port)

    def _reader(self, cls: type[MetricReader], *args, **kwargs) -> MetricReader:
        reader = _bridged(cls)(*args, **kwargs)
        self._attach(reader)
        return reader

    def _attach(self, reader: MetricReader) -> None:
        if isinstance(reader, _ProducerMixin):
            reader._producers = self.producers
            reader._resource = self.resource

    def add_producer(self, producer: Producer) -> None:
        self.producers.append(producer)

    def shutdown(self) -> None:
        if self._http is not None:
            self._http.shutdown()
            self._http = None
        self.provider.shutdown()


BridgedInMemoryMetricReader = _bridged(InMemoryMetricReader)

_lock = threading.Lock()
_metrics: Metrics | None = None


def configure_metrics(options: MetricsOptions) -> Metrics:
    """Set up this process's metrics once; later calls return the same object."""
    global _metrics
    with _lock:
        if _metrics is None:
            _metrics = Metrics(options)
        return _metrics


def current_metrics() -> Metrics | None:
    return _metrics


# -- collective metrics (the telemetry service) --------------------------------------------------

SeriesTotalsRow = tuple[str, str, str, int, SeriesTotals]  # group, gpu, op, group_size, totals


def collective_metrics(rows: list[SeriesTotalsRow], *, start_ns: int, now_ns: int) -> list[Metric]:
    """The ``shardline.collective.*`` metrics from per-series totals: one series per rank and op
    type (attributes ``replica_group_id``, ``gpu_id``, ``op_type``, ``group_size``), so a
    dashboard shows p99 by op and by rank, and ``sum by (op_type)`` the group's."""
    merged: dict[tuple[str, str, str, int], SeriesTotals] = {}
    for group, gpu, op, group_size, t in rows:
        m = merged.get((group, gpu, op, group_size))
        if m is None:
            merged[(group, gpu, op, group_size)] = m = SeriesTotals()
        m.count += t.count
        m.bytes += t.bytes
        m.timeouts += t.timeouts
        m.sum_ms += t.sum_ms
        m.bucket_counts = [a + b for a, b in zip(m.bucket_counts, t.bucket_counts, strict=True)]
        m.min_ms = min(m.min_ms, t.min_ms)
        m.max_ms = max(m.max_ms, t.max_ms)
    hist, nbytes, timeouts = [], [], []
    for (group, gpu, op, group_size), t in sorted(merged.items()):
        attrs = {"replica_group_id": group, "gpu_id": gpu, "op_type": op, "group_size": group_size}
        hist.append(HistogramDataPoint(attributes=attrs, start_time_unix_nano=start_ns, time_unix_nano=now_ns,
                                       count=t.count, sum=t.sum_ms / 1e3, bucket_counts=list(t.bucket_counts),
                                       explicit_bounds=list(DURATION_BOUNDS_S),
                                       min=t.min_ms / 1e3 if t.count else 0.0, max=t.max_ms / 1e3))
        nbytes.append(NumberDataPoint(attributes=attrs, start_time_unix_nano=start_ns, time_unix_nano=now_ns,
                                      value=t.bytes))
        timeouts.append(NumberDataPoint(attributes=attrs, start_time_unix_nano=start_ns, time_unix_nano=now_ns,
                                        value=t.timeouts))
    if not hist:
        return []
    cumulative = AggregationTemporality.CUMULATIVE
    return [
        Metric("shardline.collective.duration", "Duration of collective and point-to-point ops, per rank",
               "s", Histogram(hist, cumulative)),
        Metric("shardline.collective.bytes", "Payload bytes of collective ops, summed over ranks", "By",
               Sum(nbytes, cumulative, is_monotonic=True)),
        Metric("shardline.collective.timeouts", "Collective ops that hit the coordinator's timeout", "{timeout}",
               Sum(timeouts, cumulative, is_monotonic=True)),
    ]


# -- worker gauges -------------------------------------------------------------------------------

def register_engine_gauges(meter: Meter, replica_group_id: str, stats: Callable[[], dict]) -> None:
    """KV-cache utilization and running/waiting requests of one engine, read at collection."""
    attrs = {"replica_group_id": replica_group_id}

    def read(key: Callable[[dict], float]) -> Callable[[CallbackOptions], list[Observation]]:
        def callback(_options: CallbackOptions) -> list[Observation]:
            try:
                return [Observation(key(stats()), attrs)]
            except Exception:  # the engine is gone or failing: report nothing
                return []
        return callback

    meter.create_observable_gauge(
        "shardline.kv_cache.usage_ratio", unit="1", description="Fraction of the KV cache in use",
        callbacks=[read(lambda s: s["kv_bytes_used"] / max(1, s["kv_bytes_capacity"]))])
    meter.create_observable_gauge("shardline.requests.running", unit="{request}",
                                  description="Requests being decoded", callbacks=[read(lambda s: s["running"])])
    meter.create_observable_gauge("shardline.requests.waiting", unit="{request}",
                                  description="Requests queued for admission", callbacks=[read(lambda s: s["waiting"])])


def register_shipper_counters(meter: Meter, shipper, gpu_id: str) -> None:
    """Counters of a rank's :class:`~services.telemetry.client.TelemetryShipper`."""
    attrs = {"gpu_id": gpu_id}

    def read(name: str) -> Callable[[CallbackOptions], list[Observation]]:
        return lambda _options: [Observation(getattr(shipper, name), attrs)]

    meter.create_observable_counter("shardline.telemetry.events.dropped", unit="{event}",
                                    description="Collective events dropped (buffer full or telemetry down)",
                                    callbacks=[read("dropped")])
    meter.create_observable_counter("shardline.telemetry.events.shipped", unit="{event}",
                                    description="Collective events handed to the telemetry stream",
                                    callbacks=[read("sent")])
