"""Instrumenting a serving engine: its gauges and shipper counters on this process's metrics,
and engine-step spans when tracing is on. A no-op when neither is configured."""

from __future__ import annotations

from opentelemetry import trace

from services.telemetry.otel import current_metrics, register_engine_gauges, register_shipper_counters
from services.telemetry.tracing import StepTracer, attach_step_tracer


def tracing_enabled() -> bool:
    # deferred: the tracing SDK only when tracing is configured
    from opentelemetry.sdk.trace import TracerProvider

    return isinstance(trace.get_tracer_provider(), TracerProvider)


def instrument_engine(engine, replica_group_id: str, shipper=None) -> StepTracer | None:
    """Call once the driver's engine is built (``services.worker.driver.ReplicaDriver.start``)."""
    metrics = current_metrics()
    if metrics is not None:
        register_engine_gauges(metrics.meter, replica_group_id, engine.stats)
        if shipper is not None:
            register_shipper_counters(metrics.meter, shipper, engine.coordinator.gpu_id)
    return attach_step_tracer(engine) if tracing_enabled() else None
