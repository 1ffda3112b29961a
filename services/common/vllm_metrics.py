"""vLLM's Prometheus metrics, under vLLM's names, types, units, labels and buckets.

Operators' dashboards, alert rules and autoscalers (KEDA on ``vllm:num_requests_waiting``, the
Gateway API Inference Extension reading ``vllm:kv_cache_usage_perc``, vLLM's own Grafana
dashboards) are written against these series, so a shardline fleet serves them as vLLM 0.32 does
(its ``vllm/v1/metrics/loggers.py`` and ``buckets.py``): labels ``model_name`` and ``engine`` (a
worker is one engine, ``"0"``). Two kinds of process expose them:

- each worker, for its engine (``services.worker.engine_metrics``), as a vLLM server would;
- each router, for the requests it streamed, with a third label ``replica_group`` (the group that
  served them), and the groups' gauges and prefix-cache counters from their Stats.

The request-level histograms take a :class:`RequestTimes` (seconds) at the request's end. The
gauges and the cumulative counters a worker already keeps come from a scrape-time collector
(:func:`engine_families`), so nothing is written per step for them.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from services.common.sampling import FinishReason

LABELS = ("model_name", "engine")
ENGINE = "0"

# vLLM's bucket families (vllm/v1/metrics/buckets.py)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                           120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
TIME_TO_FIRST_TOKEN_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                               7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
INTER_TOKEN_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                               10.0, 20.0, 40.0, 80.0)
ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
REQUEST_PARAMS_N_BUCKETS = (1, 2, 5, 10, 20)


def request_tokens_buckets(max_model_len: int) -> list[float]:
    """1, 2, 5, 10, 20, 50, ... up to ``max_model_len`` (vLLM's ``build_1_2_5_buckets``)."""
    out: list[float] = []
    exponent = 0
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * 10**exponent
            if value > max_model_len:
                return out
            out.append(value)
        exponent += 1


# vLLM's finished_reason values: a stop string or EOS is "stop"; a client's cancel "abort"
FINISHED_REASON = {FinishReason.EOS_TOKEN: "stop", FinishReason.STOP_SEQUENCE: "stop",
                   FinishReason.LENGTH: "length", FinishReason.CANCELLED: "abort", FinishReason.ERROR: "error"}


@dataclass(frozen=True, slots=True)
class RequestTimes:
    """One finished request as vLLM's request histograms see it (seconds, tokens). ``queue_s``:
    arrival to first scheduled; ``prefill_s``: first scheduled to first token; ``decode_s``:
    first to last token; ``intervals_s``: between consecutive tokens."""

    reason: FinishReason
    prompt_tokens: int
    generation_tokens: int
    max_tokens: int
    e2e_s: float
    ttft_s: float | None
    queue_s: float
    prefill_s: float
    decode_s: float
    intervals_s: Sequence[float] = ()
    n: int = 1


class VllmMetrics:
    """The request-level series (counters and histograms), with ``LABELS`` + ``extra`` labels."""

    def __init__(self, max_model_len: int, *, extra: Sequence[str] = (),
                 registry: CollectorRegistry | None = None) -> None:
        labels = [*LABELS, *extra]
        kw = {"labelnames": labels, **({"registry": registry} if registry is not None else {})}
        tokens = request_tokens_buckets(max_model_len)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Number of prefill tokens processed.", **kw)
        self.generation_tokens = Counter("vllm:generation_tokens", "Number of generation tokens processed.", **kw)
        self.request_success = Counter("vllm:request_success", "Count of successfully processed requests.",
                                       **{**kw, "labelnames": [*labels, "finished_reason"]})
        self.request_prompt_tokens = Histogram("vllm:request_prompt_tokens", "Number of prefill tokens processed.",
                                               buckets=tokens, **kw)
        self.request_generation_tokens = Histogram("vllm:request_generation_tokens",
                                                   "Number of generation tokens processed.", buckets=tokens, **kw)
        self.max_tokens = Histogram("vllm:request_params_max_tokens",
                                    "Histogram of the max_tokens request parameter.", buckets=tokens, **kw)
        self.params_n = Histogram("vllm:request_params_n", "Histogram of the n request parameter.",
                                  buckets=REQUEST_PARAMS_N_BUCKETS, **kw)
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                              buckets=TIME_TO_FIRST_TOKEN_BUCKETS, **kw)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                             buckets=INTER_TOKEN_LATENCY_BUCKETS, **kw)
        self.tpot = Histogram("vllm:request_time_per_output_token_seconds",
                              "Histogram of time_per_output_token_seconds per request.",
                              buckets=INTER_TOKEN_LATENCY_BUCKETS, **kw)
        latency = {"buckets": REQUEST_LATENCY_BUCKETS, **kw}
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                             **latency)
        self.queue = Histogram("vllm:request_queue_time_seconds",
                               "Histogram of time spent in WAITING phase for request.", **latency)
        self.inference = Histogram("vllm:request_inference_time_seconds",
                                   "Histogram of time spent in RUNNING phase for request.", **latency)
        self.prefill = Histogram("vllm:request_prefill_time_seconds",
                                 "Histogram of time spent in PREFILL phase for request.", **latency)
        self.decode = Histogram("vllm:request_decode_time_seconds",
                                "Histogram of time spent in DECODE phase for request.", **latency)
        self._children: dict[tuple[str, ...], tuple] = {}

    def _of(self, labels: tuple[str, ...]) -> tuple:
        children = self._children.get(labels)
        if children is None:
            children = self._children[labels] = tuple(metric.labels(*labels) for metric in (
                self.prompt_tokens, self.generation_tokens, self.request_prompt_tokens,
                self.request_generation_tokens, self.max_tokens, self.params_n, self.ttft, self.itl, self.tpot,
                self.e2e, self.queue, self.inference, self.prefill, self.decode))
        return children

    def tokens_processed(self, labels: tuple[str, ...], prompt: int, generation: int) -> None:
        """Tokens as they are processed (a worker counts per step, as vLLM does)."""
        children = self._of(labels)
        if prompt:
            children[0].inc(prompt)
        if generation:
            children[1].inc(generation)

    def request_finished(self, labels: tuple[str, ...], t: RequestTimes, *, count_tokens: bool = False) -> None:
        """One request's histograms and its ``request_success``; ``count_tokens``: also add its
        tokens to the two token counters (a router, which sees requests, not steps)."""
        (prompt_c, generation_c, prompt_h, generation_h, max_tokens, params_n, ttft, itl, tpot, e2e, queue,
         inference, prefill, decode) = self._of(labels)
        self.request_success.labels(*labels, FINISHED_REASON.get(t.reason, "error")).inc()
        if count_tokens:
            prompt_c.inc(t.prompt_tokens)
            generation_c.inc(t.generation_tokens)
        prompt_h.observe(t.prompt_tokens)
        generation_h.observe(t.generation_tokens)
        max_tokens.observe(t.max_tokens)
        params_n.observe(t.n)
        if t.ttft_s is not None:
            ttft.observe(t.ttft_s)
        for interval in t.intervals_s:
            itl.observe(interval)
        if t.generation_tokens > 1:
            tpot.observe(t.decode_s / (t.generation_tokens - 1))
        e2e.observe(t.e2e_s)
        queue.observe(t.queue_s)
        inference.observe(max(0.0, t.e2e_s - t.queue_s))
        prefill.observe(t.prefill_s)
        decode.observe(t.decode_s)


@dataclass(frozen=True, slots=True)
class EngineState:
    """What a scrape reads of one engine: its queues, KV use and cumulative prefix-cache and
    preemption counts (since it started)."""

    labels: tuple[str, ...]
    running: int
    waiting: int
    kv_usage: float  # 0..1
    prefix_queries: int
    prefix_hits: int
    preemptions: int | None = None  # None: not known where this is exposed (a router)


def engine_families(states: Iterable[EngineState], extra: Sequence[str] = ()) -> list:
    """vLLM's scheduler gauges and cache counters for ``states``, built at scrape time."""
    labels = [*LABELS, *extra]
    running = GaugeMetricFamily("vllm:num_requests_running", "Number of requests in model execution batches.",
                                labels=labels)
    waiting = GaugeMetricFamily("vllm:num_requests_waiting", "Number of requests waiting to be processed.",
                                labels=labels)
    usage = GaugeMetricFamily("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
                              labels=labels)
    queries = CounterMetricFamily("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of "
                                  "queried tokens.", labels=labels)
    hits = CounterMetricFamily("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.",
                               labels=labels)
    preemptions = CounterMetricFamily("vllm:num_preemptions", "Cumulative number of preemption from the engine.",
                                      labels=labels)
    for s in states:
        running.add_metric(s.labels, s.running)
        waiting.add_metric(s.labels, s.waiting)
        usage.add_metric(s.labels, s.kv_usage)
        queries.add_metric(s.labels, s.prefix_queries)
        hits.add_metric(s.labels, s.prefix_hits)
        if s.preemptions is not None:
            preemptions.add_metric(s.labels, s.preemptions)
    return [running, waiting, usage, queries, hits, preemptions]
