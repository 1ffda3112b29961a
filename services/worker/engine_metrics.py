"""A worker's engine under vLLM's metric names (``services.common.vllm_metrics``).

:class:`EngineMetrics` is an engine step listener (``LLMEngine.step_listeners``): it stamps each
request's submission, first scheduled step, first and later tokens, and at its end observes
vLLM's request histograms (TTFT, inter-token latency, queue/prefill/decode/e2e time, token
counts) and ``request_success{finished_reason}``. Prompt and generation tokens are counted per
step, as vLLM counts them; ``vllm:iteration_tokens_total`` takes each step's token count. The
gauges (running, waiting, KV use) and the cumulative prefix-cache and preemption counters are
read from ``engine.stats()`` at scrape time (:class:`EngineCollector`). Only a worker that serves
``/metrics`` attaches them (``attach_engine_metrics``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from prometheus_client import REGISTRY, CollectorRegistry, Histogram

from services.common.sampling import FinishReason
from services.common.vllm_metrics import (
    ENGINE,
    ITERATION_TOKENS_BUCKETS,
    EngineState,
    RequestTimes,
    VllmMetrics,
    engine_families,
)


@dataclass(slots=True)
class _Timing:
    handle: object  # the engine's RequestHandle
    submitted: float
    scheduled: float = 0.0
    first: float = 0.0
    last: float = 0.0
    intervals: list[float] = field(default_factory=list)


class EngineMetrics:
    """The step listener (see the module docstring); ``on_submit`` runs on the submitting thread,
    the rest on the engine's loop thread."""

    def __init__(self, engine, model_name: str, metrics: VllmMetrics, iteration_tokens: Histogram) -> None:
        self.engine = engine
        self.labels = (model_name, ENGINE)
        self.metrics = metrics
        self.iteration_tokens = iteration_tokens.labels(*self.labels)
        self._requests: dict[int, _Timing] = {}

    def on_submit(self, handle) -> None:
        self._requests[handle.seq_id] = _Timing(handle, time.monotonic())

    def on_step_scheduled(self, plan) -> None:
        now = time.monotonic()
        requests = self._requests
        for s in plan.seqs:
            timing = requests.get(s.seq_id)
            if timing is not None and not timing.scheduled:
                timing.scheduled = now

    def on_step_done(self, plan, result) -> None:
        now = time.monotonic()
        self.iteration_tokens.observe(plan.num_tokens)
        requests = self._requests
        prompt = generated = 0
        for token in result.sampled:
            timing = requests.get(token.seq_id)
            if timing is None:
                continue
            generated += 1
            if not timing.first:
                timing.first = now
                prompt += timing.handle.seq.num_prompt_tokens
            else:
                timing.intervals.append(now - timing.last)
            timing.last = now
        self.metrics.tokens_processed(self.labels, prompt, generated)

    def on_request_done(self, seq_id: int) -> None:
        timing = self._requests.pop(seq_id, None)
        if timing is None:
            return
        now = time.monotonic()
        seq = timing.handle.seq
        failed = self.engine.failure is not None
        reason = seq.finish_reason or (FinishReason.ERROR if failed else FinishReason.CANCELLED)
        scheduled = timing.scheduled or now
        first, last = timing.first or now, timing.last or now
        self.metrics.request_finished(self.labels, RequestTimes(
            reason, seq.num_prompt_tokens, seq.num_output_tokens, seq.sampling_params.max_tokens,
            e2e_s=now - timing.submitted, ttft_s=(timing.first - timing.submitted) if timing.first else None,
            queue_s=scheduled - timing.submitted, prefill_s=max(0.0, first - scheduled),
            decode_s=max(0.0, last - first), intervals_s=timing.intervals))


class EngineCollector:
    """vLLM's gauges and cumulative cache counters of one engine, read at scrape time."""

    def __init__(self, engine, model_name: str) -> None:
        self.engine = engine
        self.labels = (model_name, ENGINE)

    def collect(self):
        try:
            s = self.engine.stats()
        except Exception:  # noqa: BLE001 - the engine is gone or failing: report nothing
            return []
        return engine_families([EngineState(
            self.labels, s["running"], s["waiting"], s["kv_bytes_used"] / max(1, s["kv_bytes_capacity"]),
            s["prefix_cache_queries"], s["prefix_cache_hits"], s["num_preemptions"])])


def attach_engine_metrics(engine, model_name: str, *, registry: CollectorRegistry = REGISTRY) -> EngineMetrics:
    """Register the engine's vLLM series in ``registry`` (once per process) and start stamping."""
    metrics = VllmMetrics(engine.scheduler.max_tokens_supported(), registry=registry)
    iteration_tokens = Histogram("vllm:iteration_tokens_total", "Histogram of number of tokens per engine_step.",
                                 ["model_name", "engine"], buckets=ITERATION_TOKENS_BUCKETS, registry=registry)
    registry.register(EngineCollector(engine, model_name))
    listener = EngineMetrics(engine, model_name, metrics, iteration_tokens)
    engine.step_listeners.append(listener)
    return listener
