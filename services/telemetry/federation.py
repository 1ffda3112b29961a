"""Pull other processes' ``shardline_*`` metrics into this process's Prometheus registry.

The router's HTTP port is the local stack's one scrape target. Its ``/metrics`` is rendered
from ``prometheus_client``'s default registry; registering an :class:`UpstreamMetricsCollector`
there makes every scrape also fetch the telemetry service's (and the workers') ``/metrics``,
keep the ``shardline_`` families and merge them in. Families with the same name from several
upstreams (a gauge of each worker) are merged into one, as the exposition format requires, and
process/runtime families (``python_gc_*``, ``process_*``) of the upstreams are left out so they
do not clash with the router's own. An upstream that does not answer within ``timeout_s`` is
skipped for that scrape and shows as ``shardline_metrics_upstream_up{upstream=...} 0``.

Router side (two lines, once its own metrics are defined)::

    from services.telemetry.federation import register_upstreams
    register_upstreams(["http://127.0.0.1:9465/metrics"])  # the telemetry service's --metrics-port

Families the router already exports itself (``shardline_kv_cache_usage_ratio``,
``shardline_requests_running``) are left out of what is pulled in.
"""

from __future__ import annotations

import logging
import urllib.error
import urllib.request
from collections.abc import Iterable, Iterator, Sequence

from prometheus_client import REGISTRY, CollectorRegistry
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families

from services.common.transport_security import TransportSecurity

log = logging.getLogger(__name__)

DEFAULT_PREFIX = "shardline_"


class UpstreamMetricsCollector:
    """A ``prometheus_client`` collector that scrapes upstream ``/metrics`` URLs on collect."""

    def __init__(self, urls: Sequence[str], *, prefix: str = DEFAULT_PREFIX, timeout_s: float = 1.0,
                 exclude: Iterable[str] = (), security: TransportSecurity | None = None) -> None:
        self.urls = list(urls)
        # an https upstream is verified against the CA; the internal token opens a --metrics-auth one
        self.security = security or TransportSecurity()
        self.prefix = prefix
        self.timeout_s = timeout_s
        self.exclude = frozenset(exclude)  # family names this process exports itself

    def describe(self) -> list[Metric]:
        return []  # unknown until scraped; keeps registration from calling collect()

    def collect(self) -> Iterator[Metric]:
        merged: dict[str, Metric] = {}
        up = GaugeMetricFamily("shardline_metrics_upstream_up", "Whether an upstream /metrics answered the last scrape",
                               labels=["upstream"])
        for url in self.urls:
            try:
                text = self._fetch(url)
            except (urllib.error.URLError, OSError, ValueError) as exc:
                log.debug("upstream %s did not answer: %s", url, exc)
                up.add_metric([url], 0)
                continue
            up.add_metric([url], 1)
            for family in text_string_to_metric_families(text):
                if not family.name.startswith(self.prefix) or _exposed_names(family) & self.exclude:
                    continue
                into = merged.get(family.name)
                if into is None:
                    merged[family.name] = family
                elif into.type == family.type:
                    into.samples.extend(family.samples)
        yield from merged.values()
        yield up

    def _fetch(self, url: str) -> str:
        request = urllib.request.Request(url, headers=self.security.http_headers())
        context = self.security.client_ssl_context() if url.startswith("https:") else None
        with urllib.request.urlopen(request, timeout=self.timeout_s, context=context) as response:  # noqa: S310
            return response.read().decode("utf-8")

    def set_urls(self, urls: Iterable[str]) -> None:
        """Replace the upstream list (workers come and go)."""
        self.urls = list(urls)


def register_upstreams(urls: Sequence[str], *, registry: CollectorRegistry = REGISTRY,
                       timeout_s: float = 1.0, security: TransportSecurity | None = None) -> UpstreamMetricsCollector:
    """Register a collector for ``urls`` in ``registry``, leaving out the families ``registry``
    already exports (two families of one name would make the exposition invalid)."""
    own = {name for family in registry.collect() for name in _exposed_names(family)}
    collector = UpstreamMetricsCollector(urls, timeout_s=timeout_s, exclude=own, security=security)
    registry.register(collector)
    return collector


def _exposed_names(family: Metric) -> set[str]:
    """The names a family is exposed under: a counter ``x`` is written as ``x_total``."""
    return {family.name, f"{family.name}_total"} if family.type == "counter" else {family.name}
