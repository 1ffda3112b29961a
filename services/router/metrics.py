"""The router's Prometheus metrics, on prometheus_client's default registry.

``GET /metrics`` on the HTTP port exposes that registry as a whole, so other modules that run
in the router process (collective telemetry, for one) add their metrics just by defining them.
The metric objects live at module level: a registry accepts each name once per process.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from prometheus_client import REGISTRY, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from services.common.errors import ShardlineError
from services.common.vllm_metrics import ENGINE, EngineState, RequestTimes, VllmMetrics, engine_families
from services.router.types import Finished

if TYPE_CHECKING:
    from services.quality.shadow_window import WindowFigures

REQUESTS = Counter("shardline_router_requests", "Requests that ended, by model and outcome "
                   "(a finish reason, or the error that ended them)", ["model", "outcome"])
RUNNING = Gauge("shardline_requests_running", "Requests streaming through the router, by replica group",
                ["replica_group_id"])
QUEUE_DEPTH = Gauge("shardline_router_queue_depth", "Requests waiting in the admission queue for KV headroom")
KV_USAGE = Gauge("shardline_kv_cache_usage_ratio", "KV cache utilization of each replica group as last reported "
                 "(kv_bytes_used / kv_bytes_capacity, per GPU of the fullest stage)", ["replica_group_id"])
KV_RESERVED = Gauge("shardline_router_kv_reserved_bytes", "KV bytes the router has reserved on each replica group",
                    ["replica_group_id"])
PROMPT_TOKENS = Counter("shardline_router_prompt_tokens", "Prompt tokens of finished requests", ["model"])
GENERATED_TOKENS = Counter("shardline_router_generation_tokens", "Tokens streamed to clients", ["model"])
TTFT = Histogram("shardline_router_time_to_first_token_seconds", "From arrival at the router to the first token",
                 buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30))


class PrefixCacheCollector:
    """Each replica group's prefix-cache counters as its worker last reported them (cumulative
    since the worker started, so exposed as counters, under vLLM's names for them): prompt tokens
    looked up and found, evictions, and the cached blocks now."""

    def __init__(self) -> None:
        self.groups: dict[str, tuple[int, int, int, int]] = {}

    def collect(self):
        queries = CounterMetricFamily("shardline_prefix_cache_queries", "Prompt tokens looked up in each replica "
                                      "group's prefix cache at admission", labels=["replica_group_id"])
        hits = CounterMetricFamily("shardline_prefix_cache_hits", "Prompt tokens found in each replica group's "
                                   "prefix cache (their prefill skipped)", labels=["replica_group_id"])
        evictions = CounterMetricFamily("shardline_prefix_cache_evictions", "Cached KV blocks each replica group "
                                        "took for new contents", labels=["replica_group_id"])
        blocks = GaugeMetricFamily("shardline_prefix_cache_blocks", "KV blocks findable by a prefix hash in each "
                                   "replica group (held or evictable)", labels=["replica_group_id"])
        for group, (q, h, cached, evicted) in sorted(self.groups.items()):
            queries.add_metric([group], q)
            hits.add_metric([group], h)
            evictions.add_metric([group], evicted)
            blocks.add_metric([group], cached)
        return [queries, hits, evictions, blocks]


PREFIX_CACHE = PrefixCacheCollector()
REGISTRY.register(PREFIX_CACHE)


class VllmGroupsCollector:
    """vLLM's scheduler gauges and cache counters of every replica group, labelled
    ``replica_group``, as the group's last Stats said (``services.common.vllm_metrics``)."""

    def __init__(self) -> None:
        self.groups: dict[str, EngineState] = {}

    def collect(self):
        return engine_families(list(self.groups.values()), extra=("replica_group",))


VLLM_GROUPS = VllmGroupsCollector()
REGISTRY.register(VLLM_GROUPS)
_vllm_requests: VllmMetrics | None = None


def vllm_request_metrics(max_model_len: int) -> VllmMetrics:
    """vLLM's request series of the requests this router streams, labelled ``replica_group``:
    one set per process (a registry takes each name once), made by the first router of it."""
    global _vllm_requests
    if _vllm_requests is None:
        _vllm_requests = VllmMetrics(max_model_len, extra=("replica_group",))
    return _vllm_requests


def outcome_of(exc: BaseException) -> str:
    """``InvalidArgument`` -> ``invalid_argument``; other exceptions -> ``internal``."""
    if not isinstance(exc, ShardlineError):
        return "internal"
    name = type(exc).__mro__[0].__name__
    for cls in type(exc).__mro__:
        if cls.__module__ == "services.common.errors" and cls is not ShardlineError:
            name = cls.__name__
            break
    return "".join(f"_{c.lower()}" if c.isupper() else c for c in name).lstrip("_")


class RouterMetrics:
    """Updates the module's metrics from the request path and the pollers. The request path's
    labelled children are looked up once per label value (``labels()`` hashes and locks)."""

    def __init__(self, max_model_len: int = 2048) -> None:
        self._running: dict[str, Any] = {}
        self._per_model: dict[str, tuple[Any, Any]] = {}
        self.vllm = vllm_request_metrics(max_model_len)

    def bind_queue_depth(self, depth: Callable[[], int]) -> None:
        QUEUE_DEPTH.set_function(depth)

    def _running_of(self, replica_group_id: str) -> Any:
        child = self._running.get(replica_group_id)
        if child is None:
            child = self._running[replica_group_id] = RUNNING.labels(replica_group_id)
        return child

    def request_started(self, replica_group_id: str) -> None:
        self._running_of(replica_group_id).inc()

    def request_ended(self, replica_group_id: str) -> None:
        self._running_of(replica_group_id).dec()

    def request_finished(self, model: str, finished: Finished, *, replica_group: str = "", max_tokens: int = 0,
                         token_ns: list[int] | None = None) -> None:
        """A request that ended with a finish reason; ``token_ns``: when each of its tokens came
        (monotonic ns), for the inter-token latencies."""
        REQUESTS.labels(model, finished.reason.value).inc()
        tokens = self._per_model.get(model)
        if tokens is None:
            tokens = self._per_model[model] = (PROMPT_TOKENS.labels(model), GENERATED_TOKENS.labels(model))
        tokens[0].inc(finished.prompt_tokens)
        tokens[1].inc(finished.completion_tokens)
        t = finished.timings
        if t.time_to_first_token_ns:
            TTFT.observe(t.time_to_first_token_ns / 1e9)
        stamps = token_ns or ()
        queue_s = t.queue_ns / 1e9
        ttft_s = t.time_to_first_token_ns / 1e9 if t.time_to_first_token_ns else None
        self.vllm.request_finished((model, ENGINE, replica_group), RequestTimes(
            finished.reason, finished.prompt_tokens, finished.completion_tokens,
            max_tokens or finished.completion_tokens, e2e_s=t.total_ns / 1e9, ttft_s=ttft_s, queue_s=queue_s,
            prefill_s=max(0.0, ttft_s - queue_s) if ttft_s is not None else 0.0, decode_s=t.decode_ns / 1e9,
            intervals_s=[(b - a) / 1e9 for a, b in zip(stamps, stamps[1:])]), count_tokens=True)

    def request_failed(self, model: str, exc: BaseException, *, replica_group: str = "") -> None:
        outcome = outcome_of(exc)
        REQUESTS.labels(model, outcome).inc()
        self.vllm.request_success.labels(model, ENGINE, replica_group,
                                         "abort" if outcome == "request_cancelled" else "error").inc()

    def group_reported(self, replica_group_id: str, used: int, capacity: int, reserved: int, *,
                       prefix_cache: tuple[int, int, int, int] = (0, 0, 0, 0), model: str = "", running: int = 0,
                       waiting: int = 0, preemptions: int = 0) -> None:
        if not replica_group_id:
            return
        KV_USAGE.labels(replica_group_id).set(used / capacity if capacity else 0.0)
        KV_RESERVED.labels(replica_group_id).set(reserved)
        PREFIX_CACHE.groups[replica_group_id] = prefix_cache
        VLLM_GROUPS.groups[replica_group_id] = EngineState(
            (model, ENGINE, replica_group_id), running, waiting, used / capacity if capacity else 0.0,
            prefix_cache[0], prefix_cache[1], preemptions)


# shadow traffic (``shadow.py``): per (incumbent, candidate) pair of replica groups
SHADOW_REQUESTS = Counter("shardline_shadow_requests", "Mirrored requests by pair and outcome (compared: scored "
                          "by the candidate; failed: its Score failed; skipped: a named candidate unknown, "
                          "unroutable or serving another model)", ["incumbent", "candidate", "outcome"])
SHADOW_DROPPED = Counter("shardline_shadow_dropped", "Finished requests not mirrored: the shadow queue was full")
SHADOW_QUEUE_DEPTH = Gauge("shardline_shadow_queue_depth", "Finished requests waiting to be mirrored (the one being "
                           "scored included)")
SHADOW_TOKENS = Counter("shardline_shadow_tokens", "Generated tokens compared on the candidate",
                        ["incumbent", "candidate"])
SHADOW_WINDOW_TOKENS = Gauge("shardline_shadow_window_tokens", "Mirrored positions in the pair's rolling window",
                             ["incumbent", "candidate"])
SHADOW_PPL_DELTA = Gauge("shardline_shadow_perplexity_delta_pct", "Candidate's perplexity vs the incumbent's on "
                         "the window's mirrored tokens, 100 * (ppl_candidate / ppl_incumbent - 1)",
                         ["incumbent", "candidate"])
SHADOW_ABS_DELTA = Gauge("shardline_shadow_mean_abs_logprob_delta", "Mean |candidate - incumbent logprob| over "
                         "the window's mirrored tokens", ["incumbent", "candidate"])
SHADOW_PROMPT_TOKENS = Gauge("shardline_shadow_prompt_window_tokens", "Prompt positions in the pair's rolling "
                             "prompt window (scored by both groups)", ["incumbent", "candidate"])
SHADOW_PROMPT_PPL_DELTA = Gauge("shardline_shadow_prompt_perplexity_delta_pct", "Candidate's perplexity vs the "
                                "incumbent's on the prompt window's positions (the clients' own text, chosen by "
                                "neither group)", ["incumbent", "candidate"])
SHADOW_PROMPT_ABS_DELTA = Gauge("shardline_shadow_prompt_mean_abs_logprob_delta", "Mean |candidate - incumbent "
                                "logprob| over the prompt window's positions", ["incumbent", "candidate"])
SHADOW_TOP1 = Gauge("shardline_shadow_top1_agreement", "Share of the window's greedy tokens that are the "
                    "candidate's argmax too (NaN before a greedy request was mirrored)", ["incumbent", "candidate"])
SHADOW_ALERTS = Counter("shardline_shadow_alerts", "Divergence alerts for the pair's candidate, by outcome "
                        "(raised, or failed: telemetry unreachable)", ["incumbent", "candidate", "outcome"])


class ShadowMetrics:
    """The shadow mirror's :class:`~services.router.shadow.ShadowObserver` (its thread calls it)."""

    def bind_queue_depth(self, depth: Callable[[], int]) -> None:
        SHADOW_QUEUE_DEPTH.set_function(depth)

    def dropped(self) -> None:
        SHADOW_DROPPED.inc()

    def scored(self, incumbent: str, candidate: str, outcome: str, tokens: int) -> None:
        SHADOW_REQUESTS.labels(incumbent, candidate, outcome).inc()
        if tokens:
            SHADOW_TOKENS.labels(incumbent, candidate).inc(tokens)

    def window(self, incumbent: str, candidate: str, figures: WindowFigures) -> None:
        SHADOW_WINDOW_TOKENS.labels(incumbent, candidate).set(figures.tokens)
        SHADOW_PPL_DELTA.labels(incumbent, candidate).set(figures.perplexity_delta_pct)
        SHADOW_ABS_DELTA.labels(incumbent, candidate).set(figures.mean_abs_logprob_delta)
        SHADOW_TOP1.labels(incumbent, candidate).set(figures.top1_agreement)

    def prompt_window(self, incumbent: str, candidate: str, figures: WindowFigures) -> None:
        SHADOW_PROMPT_TOKENS.labels(incumbent, candidate).set(figures.tokens)
        SHADOW_PROMPT_PPL_DELTA.labels(incumbent, candidate).set(figures.perplexity_delta_pct)
        SHADOW_PROMPT_ABS_DELTA.labels(incumbent, candidate).set(figures.mean_abs_logprob_delta)

    def alert(self, incumbent: str, candidate: str, outcome: str) -> None:
        SHADOW_ALERTS.labels(incumbent, candidate, outcome).inc()
