"""A service process's metrics and traces from its flags: ``--metrics-port``, ``--otlp-endpoint``
and ``--metrics-auth`` on every service, and what they start.

Kept apart from the telemetry service (``server.py``): the worker, the fleet controller and the
telemetry service each set up their own /metrics, and a worker should not import the telemetry
service's pipeline, alert effects and registry to do it (a worker starts 0.8 s sooner without).
"""

from __future__ import annotations

import argparse

from opentelemetry import trace

from services.common.bearer_auth import BearerCheck
from services.common.config import resolve
from services.common.errors import InvalidArgument
from services.common.transport_security import TransportSecurity
from services.telemetry.otel import MetricsOptions, configure_metrics, current_metrics, otlp_endpoint_from_env
from services.telemetry.tracing import configure_tracing


def add_metrics_arguments(parser, *, default_port: int | None = None) -> None:
    """``--metrics-port`` and ``--otlp-endpoint``: the same two flags on every service.
    ``default_port``: where /metrics is served without the flag (None: off, 0: any free port)."""
    default = {None: "off", 0: "any free port"}.get(default_port, str(default_port))
    parser.add_argument("--metrics-port", type=int, default=None,
                        help=f"serve Prometheus /metrics on this port, 0 for any, -1 for none (env "
                             f"SHARDLINE_METRICS_PORT; default: {default})")
    parser.set_defaults(metrics_port_default=-1 if default_port is None else default_port)
    parser.add_argument("--otlp-endpoint", default=None,
                        help="export OpenTelemetry metrics and traces over OTLP/gRPC to host:port "
                             "(env SHARDLINE_OTLP_ENDPOINT or OTEL_EXPORTER_OTLP_ENDPOINT; default: off)")
    parser.add_argument("--metrics-auth", action="store_const", const=True, default=None,
                        help="/metrics requires 'authorization: Bearer <internal token>' (env "
                             "SHARDLINE_METRICS_AUTH; default: open)")


def setup_observability(args: argparse.Namespace, service: str):
    """Metrics (/metrics, OTLP) and traces for one service process, from its flags and env."""
    port = resolve("metrics_port", args.metrics_port, getattr(args, "metrics_port_default", -1))
    otlp = args.otlp_endpoint or otlp_endpoint_from_env()
    host = resolve("host", getattr(args, "host", None), "127.0.0.1")
    configure_tracing(service, otlp)
    security = TransportSecurity.from_args(args)
    auth = None
    if resolve("metrics_auth", getattr(args, "metrics_auth", None), False):
        if security.internal_token is None:
            raise InvalidArgument("--metrics-auth needs the internal token (SHARDLINE_INTERNAL_TOKEN): "
                                  "it is what a scraper sends")
        auth = BearerCheck(security.internal_token, what="internal token")
    return configure_metrics(MetricsOptions(service, metrics_port=None if port < 0 else port, metrics_host=host,
                                            otlp_endpoint=otlp, metrics_auth=auth,
                                            ssl_context=security.server_ssl_context()))


def flush_observability(timeout_s: float = 3.0) -> None:
    """Export what the span and metric processors still hold. For a process that leaves without
    running its exit handlers (``os._exit``): the batch span processor sends every half second,
    so without this the last requests' spans of a stopping worker were lost. Bounded: a collector
    that is gone costs at most ``timeout_s`` each."""
    millis = int(timeout_s * 1e3)
    flush = getattr(trace.get_tracer_provider(), "force_flush", None)
    if flush is not None:
        flush(millis)
    metrics = current_metrics()
    if metrics is not None:
        metrics.provider.force_flush(millis)
