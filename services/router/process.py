"""One router process's parts besides the gRPC server: worker clients and their pollers,
registry discovery, the HTTP front door, built from the command line's flags.

The request path (both front doors and every worker stream) runs on one asyncio event loop;
the pollers and registry discovery are threads of their own, as is an admission that has to
wait in the queue, and the shadow mirror (``--shadow-fraction``) that scores finished requests on
candidate groups.
"""

from __future__ import annotations

import argparse
import logging
from functools import partial

from services.common.config import resolve
from services.common.errors import InvalidArgument
from services.common.health import HealthStore, make_health_store
from services.common.sampling import SamplingParams
from services.common.transport_security import TransportSecurity
from services.router.admission import DEFAULT_MAX_QUEUE, DEFAULT_MAX_WAIT_S, AdmissionQueue, QueueConfig
from services.router.auth import ApiKeyCheck
from services.router.catalog import ModelCatalog, load_served_model
from services.router.discovery import RegistryDiscovery
from services.router.edge import DEFAULT_MAX_BODY_BYTES
from services.router.http_api import HttpServer, create_app
from services.router.metrics import RouterMetrics, ShadowMetrics
from services.router.replicas import DEFAULT_POLL_INTERVAL_S, GroupPoller, ReplicaGroupView, ReplicaSet
from services.router.routing import Router
from services.router.service import DEFAULT_MAX_CONTINUATIONS, RouterCore
from services.router.shadow import ShadowConfig, ShadowMirror
from services.router.tools import DEFAULT_PARSER
from services.router.worker_client import UpstreamScore, UpstreamStream, WorkerClient
from services.telemetry.client import raise_alert

log = logging.getLogger(__name__)
ALERT_TIMEOUT_S = 2.0  # the mirror's thread waits at most this long on telemetry per attempt
# `serve router` flag (argparse dest) -> ShadowConfig field
SHADOW_CONFIG_FIELDS = {"shadow_fraction": "fraction", "shadow_queue": "queue_size",
                        "shadow_window_tokens": "window_tokens", "shadow_min_tokens": "min_tokens",
                        "shadow_threshold_pct": "threshold_pct", "shadow_seed": "seed", "shadow_judge": "judge",
                        "shadow_idle_wait": "idle_wait_s"}


class RouterProcess:
    """Everything one router process runs besides the gRPC server."""

    def __init__(self, catalog: ModelCatalog, queue: QueueConfig, *, store: HealthStore, auth: ApiKeyCheck,
                 poll_interval_s: float = DEFAULT_POLL_INTERVAL_S,
                 max_continuations: int = DEFAULT_MAX_CONTINUATIONS,
                 max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
                 security: TransportSecurity | None = None, metrics_auth: bool = False,
                 shadow: ShadowConfig | None = None, telemetry_address: str = "", prefix_affinity: bool = True) -> None:
        self.security = security or TransportSecurity()
        replicas = ReplicaSet()
        router = Router(replicas, prefix_affinity=prefix_affinity)
        admission = AdmissionQueue(replicas, router, queue)
        metrics = RouterMetrics(max((m.max_model_len for m in catalog), default=2048))
        metrics.bind_queue_depth(admission.depth)
        self.clients: dict[str, WorkerClient] = {}
        self.shadow = self._shadow_mirror(shadow, replicas, telemetry_address)
        self.core = RouterCore(catalog, replicas, router, admission, self._open_upstream, metrics=metrics,
                               max_continuations=max_continuations, score_upstream=self._score_upstream,
                               shadow=self.shadow)
        self.store = store
        self.auth = auth
        self.poll_interval_s = poll_interval_s
        self.max_body_bytes = max_body_bytes
        self.metrics_auth = metrics_auth
        self.pollers: list[GroupPoller] = []
        self.discovery = None
        self.http = None
        self._stopped = False
        self._closed = False

    def _shadow_mirror(self, config: ShadowConfig | None, replicas: ReplicaSet,
                       telemetry_address: str) -> ShadowMirror | None:
        """The shadow mirror (started) when shadowing is on; alerts go to telemetry when the
        router knows its address, else only to the log and /metrics."""
        if config is None or not config.enabled:
            return None
        alert = partial(raise_alert, telemetry_address, timeout_s=ALERT_TIMEOUT_S,
                        security=self.security) if telemetry_address else None
        if alert is None:
            log.warning("shadow traffic without --telemetry: divergence alerts only show on /metrics and the log")
        observer = ShadowMetrics()
        mirror = ShadowMirror(config, replicas, self._score_blocking, observer=observer, raise_alert=alert)
        observer.bind_queue_depth(lambda: mirror.queue_depth)
        return mirror.start()

    def _score_blocking(self, address: str, request_id: str, token_ids: list[int], top_logprobs: int,
                        timeout_s: float) -> UpstreamScore:
        return self.clients[address].score_blocking(request_id, token_ids, top_logprobs, timeout_s)

    def _open_upstream(self, address: str, request_id: str, prompt_ids: list[int], sampling: SamplingParams,
                       trace_context: tuple[tuple[str, str], ...]) -> UpstreamStream:
        return self.clients[address].generate(request_id, prompt_ids, sampling, trace_context=trace_context)

    async def _score_upstream(self, address: str, request_id: str, token_ids: list[int],
                              top_logprobs: int) -> UpstreamScore:
        return await self.clients[address].score(request_id, token_ids, top_logprobs)

    def add_worker(self, address: str) -> None:
        """Route to the group at ``address`` from now on (polled first, so it is known at once).
        Called at start-up and from the discovery thread."""
        view, _created = self.core.replicas.add(address)
        if address in self.clients:
            return
        client = self.clients[address] = WorkerClient(address, self.security)
        metrics = self.core.metrics

        def on_update(v: ReplicaGroupView) -> None:
            if metrics is not None:
                metrics.group_reported(v.replica_group_id, v.kv_bytes_used, v.kv_bytes_capacity, v.kv_bytes_reserved,
                                       prefix_cache=v.prefix_cache, model=v.model, running=v.running,
                                       waiting=v.waiting, preemptions=v.preemptions)

        poller = GroupPoller(self.core.replicas, view, client, store=self.store, interval_s=self.poll_interval_s,
                             on_update=on_update, prefix_events=self.core.router.prefix_affinity)
        self.pollers.append(poller)
        poller.poll_once()
        poller.start()

    def start_discovery(self, registry_url: str) -> None:
        self.discovery = RegistryDiscovery(registry_url, self.core.replicas, self.add_worker).start()

    async def start_http(self, host: str, port: int) -> int:
        """Serve the OpenAI-compatible API on the running loop; returns the bound port. Raises
        OSError when the port cannot be bound."""
        app = create_app(self.core, self.auth, max_body_bytes=self.max_body_bytes, metrics_auth=self.metrics_auth)
        self.http = await HttpServer(app, host, port, security=self.security).start()
        return self.http.port

    async def stop(self) -> None:
        """Stop taking work: the HTTP front door (its open responses get a short grace),
        discovery and the pollers. Worker channels stay open for streams still relaying."""
        if self._stopped:
            return
        self._stopped = True
        if self.http is not None:
            await self.http.stop()
        if self.discovery is not None:
            self.discovery.stop()
        for poller in self.pollers:
            poller.stop()

    async def close(self) -> None:
        """After the gRPC server stopped: close the worker channels and the health store."""
        await self.stop()
        if self._closed:
            return
        self._closed = True
        if self.shadow is not None:
            self.shadow.stop()
        for client in list(self.clients.values()):
            await client.aclose()
            client.close()
        self.core.executor.shutdown(wait=False, cancel_futures=True)
        self.store.close()


def build_process(args: argparse.Namespace) -> RouterProcess:
    """The router's parts from its flags (env and defaults applied); raises ModelDirError or
    InvalidArgument for bad settings."""
    model_dirs = args.model or ([m] if (m := resolve("model", None, "")) else [])
    names = args.served_model_name or []
    if len(names) > len(model_dirs):
        raise InvalidArgument(f"{len(names)} --served-model-name for {len(model_dirs)} --model")
    templates = getattr(args, "chat_template", None) or []
    if len(templates) > len(model_dirs):
        raise InvalidArgument(f"{len(templates)} --chat-template for {len(model_dirs)} --model")
    parser = getattr(args, "tool_call_parser", None) or DEFAULT_PARSER
    catalog = ModelCatalog([load_served_model(d, name=names[i] if i < len(names) else None,
                                              max_model_len=args.max_model_len,
                                              chat_template=templates[i] if i < len(templates) else None,
                                              tool_call_parser=parser)
                            for i, d in enumerate(model_dirs)])
    queue = QueueConfig(max_size=resolve("max_queue", args.max_queue, DEFAULT_MAX_QUEUE),
                        max_wait_s=resolve("queue_timeout_s", args.queue_timeout, DEFAULT_MAX_WAIT_S))
    poll = args.poll_interval if args.poll_interval is not None else DEFAULT_POLL_INTERVAL_S
    if not 0 < poll <= 0.5:
        raise InvalidArgument(f"--poll-interval must be in (0, 0.5] seconds, got {poll}")
    max_body = resolve("max_body_bytes", getattr(args, "max_body_bytes", None), DEFAULT_MAX_BODY_BYTES)
    if max_body < 1:
        raise InvalidArgument(f"--max-body-bytes must be >= 1, got {max_body}")
    if args.max_continuations < 0:
        raise InvalidArgument(f"--max-continuations must be >= 0, got {args.max_continuations}")
    groups = tuple(getattr(args, "shadow_group", None) or ())
    given = {field: value for flag, field in SHADOW_CONFIG_FIELDS.items()
             if (value := getattr(args, flag, None)) is not None}
    shadow = ShadowConfig(candidate_group_ids=groups, **given)  # a flag not given: the config's default
    if groups and not shadow.enabled:
        raise InvalidArgument("--shadow-group needs --shadow-fraction > 0")
    telemetry = resolve("telemetry_addr", getattr(args, "telemetry", None), "")
    return RouterProcess(catalog, queue, store=make_health_store(resolve("redis_url", args.redis_url, "") or None),
                         auth=ApiKeyCheck(resolve("api_key", args.api_key, "") or None), poll_interval_s=poll,
                         max_continuations=args.max_continuations, max_body_bytes=max_body,
                         security=TransportSecurity.from_args(args),
                         metrics_auth=resolve("metrics_auth", getattr(args, "metrics_auth", None), False),
                         shadow=shadow, telemetry_address=telemetry,
                         prefix_affinity=getattr(args, "routing", "prefix") == "prefix")

