"""Traces of a request's path: router -> worker -> engine steps, linked by gRPC metadata.

The caller puts the W3C ``traceparent`` (and ``tracestate``/``baggage``) of its current span into
the call's metadata (:func:`outgoing_metadata`); the worker's ``Generate`` handler, wrapped by
:func:`traced_stream`, continues that trace in a SERVER span (a Relay stream's request carries
the same keys in its submit message and gets a span of its own, :func:`start_server_span`), and
:class:`StepTracer` adds one ``engine.step`` child span per engine step the request took part in
(its prefill chunk(s) and each decode step), with the step's batch size and phase. Steps are
shared by many requests and run on the engine thread, so the step spans are made after the fact
with the step's own start and end times, for the traced (sampled) requests only: untraced
traffic costs a dict lookup.

Nothing is exported unless :func:`configure_tracing` is given an OTLP endpoint (or an exporter,
in tests); without it the global tracer is OpenTelemetry's no-op one.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.trace import NonRecordingSpan, Span, SpanContext, SpanKind, Tracer

log = logging.getLogger(__name__)

TRACER_NAME = "shardline"
MAX_STEP_SPANS_PER_REQUEST = 512


def configure_tracing(service: str, otlp_endpoint: str | None = None, *, exporter: Any = None):
    """Install a TracerProvider exporting to ``otlp_endpoint`` (and/or ``exporter``); returns it,
    or None (and leaves the no-op tracer) when neither is given."""
    if not otlp_endpoint and exporter is None:
        return None
    # deferred: the tracing SDK only when tracing is configured
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor

    provider = TracerProvider(resource=Resource.create({"service.name": f"shardline-{service}"}))
    if otlp_endpoint:
        # deferred: an exporter only when one is configured
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=otlp_endpoint, insecure=True),
                                                       schedule_delay_millis=500))
    if exporter is not None:
        provider.add_span_processor(SimpleSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    return provider


def tracer() -> Tracer:
    return trace.get_tracer(TRACER_NAME)


def context_from_metadata(metadata: Sequence[tuple[str, Any]] | None) -> otel_context.Context:
    """The trace context a caller sent in gRPC metadata (keys are lower-case there)."""
    carrier = {k: v for k, v in (metadata or ()) if isinstance(v, str)}
    return propagate.extract(carrier)


def outgoing_metadata(ctx: otel_context.Context | None = None) -> list[tuple[str, str]]:
    """Metadata that carries the current (or given) trace context to the callee."""
    carrier: dict[str, str] = {}
    propagate.inject(carrier, context=ctx)
    return list(carrier.items())


def traced_stream(span_name: str) -> Callable:
    """Decorate a server-streaming servicer method: its body runs in a SERVER span that
    continues the trace in the call's metadata, with the span current (so work it starts, e.g.
    an engine submit, can pick it up)."""

    def decorate(method: Callable[..., Iterator[Any]]) -> Callable[..., Iterator[Any]]:
        @functools.wraps(method)
        def wrapped(self, request, context) -> Iterator[Any]:
            parent = context_from_metadata(context.invocation_metadata())
            with tracer().start_as_current_span(span_name, context=parent, kind=SpanKind.SERVER) as span:
                count = 0
                for response in method(self, request, context):
                    count += 1
                    yield response
                span.set_attribute("shardline.responses", count)

        return wrapped

    return decorate


def start_server_span(span_name: str, carrier: Mapping[str, str]) -> Span:
    """A SERVER span continuing the trace in ``carrier`` (W3C keys), for a request that is not a
    call of its own (one of a Relay stream's); the caller ends it when the request ends."""
    return tracer().start_span(span_name, context=propagate.extract(dict(carrier)), kind=SpanKind.SERVER)


class StepTracer:
    """Makes ``engine.step`` spans under the trace of every traced request in a step: an engine
    step listener (``LLMEngine.step_listeners``). A submission binds the submitting thread's
    current span to the new sequence; the step's plan and result time each step."""

    def __init__(self, *, max_step_spans: int = MAX_STEP_SPANS_PER_REQUEST) -> None:
        self.max_step_spans = max_step_spans
        self._lock = threading.Lock()
        self._requests: dict[int, list] = {}  # seq_id -> [SpanContext, spans made]
        self._started: dict[int, int] = {}  # step_id -> start (ns, wall clock)

    def bind(self, seq_id: int, span_context: SpanContext) -> None:
        if span_context.is_valid and span_context.trace_flags.sampled:
            with self._lock:
                self._requests[seq_id] = [span_context, 0]

    def on_submit(self, handle) -> None:
        self.bind(handle.seq_id, trace.get_current_span().get_span_context())

    def on_request_done(self, seq_id: int) -> None:
        if self._requests:
            with self._lock:
                self._requests.pop(seq_id, None)

    @property
    def traced(self) -> int:
        return len(self._requests)

    def on_step_scheduled(self, plan) -> None:
        if self._requests and any(s.seq_id in self._requests for s in plan.seqs):
            self._started[plan.step_id] = time.time_ns()

    def on_step_done(self, plan, result=None) -> None:
        start = self._started.pop(plan.step_id, None)
        if start is None:
            return
        end = time.time_ns()
        batch_tokens = sum(len(s.token_ids) for s in plan.seqs)
        t = tracer()
        for s in plan.seqs:
            with self._lock:
                entry = self._requests.get(s.seq_id)
                if entry is None or entry[1] >= self.max_step_spans:
                    continue
                entry[1] += 1
            phase = "prefill" if len(s.token_ids) > 1 or (s.positions and s.positions[0] == 0) else "decode"
            span = t.start_span("engine.step", context=trace.set_span_in_context(NonRecordingSpan(entry[0])),
                                start_time=start, attributes={
                                    "shardline.step_id": plan.step_id, "shardline.phase": phase,
                                    "shardline.batch_seqs": len(plan.seqs), "shardline.batch_tokens": batch_tokens,
                                    "shardline.seq_tokens": len(s.token_ids)})
            span.end(end_time=end)


def attach_step_tracer(engine, step_tracer: StepTracer | None = None) -> StepTracer:
    """Register a :class:`StepTracer` as one of an ``LLMEngine``'s step listeners."""
    st = step_tracer or StepTracer()
    engine.step_listeners.append(st)
    return st
