"""RouterService: the client-facing front door (admission, KV-headroom routing, streaming).

A thin servicer: protobuf in, a call into the router's domain modules (``service.py``,
``routing.py``, ``admission.py``, ``replicas.py``), protobuf out; domain errors become statuses
in ``services.common.grpc_server``. The same process serves the OpenAI-compatible HTTP API
(``http_api.py``) on ``--http-port`` and polls every replica group's Stats.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Iterator

import grpc

from services.common.config import ServerConfig, resolve
from services.common.errors import InvalidArgument
from services.common.grpc_server import ServiceBinding, serve_service
from services.common.logging import configure_logging
from services.common.health import HealthStore, make_health_store
from services.common.proto import common_pb2, router_pb2, router_pb2_grpc
from services.router.admission import (
    DEFAULT_MAX_QUEUE,
    DEFAULT_MAX_WAIT_S,
    AdmissionQueue,
    QueueConfig,
    RequestCancelled,
)
from services.router.auth import ApiKeyCheck
from services.router.catalog import ModelCatalog, ModelDirError, load_served_model
from services.router.metrics import RouterMetrics
from services.router.replicas import DEFAULT_POLL_INTERVAL_S, GroupPoller, GroupStatus, ReplicaGroupView, ReplicaSet
from services.router.routing import Router
from services.router.service import DEFAULT_MAX_CONTINUATIONS, RouterCore
from services.router.types import (
    DEFAULT_MAX_TOKENS,
    Finished,
    FinishReason,
    GenerationRequest,
    SamplingSpec,
    TokenOut,
)
from services.router.worker_client import WorkerClient

SERVICE = "router"
DEFAULT_HTTP_PORT = 8000
log = logging.getLogger(__name__)

FINISH_TO_PB = {
    FinishReason.LENGTH: common_pb2.FINISH_REASON_LENGTH,
    FinishReason.EOS_TOKEN: common_pb2.FINISH_REASON_EOS_TOKEN,
    FinishReason.STOP_SEQUENCE: common_pb2.FINISH_REASON_STOP_SEQUENCE,
    FinishReason.CANCELLED: common_pb2.FINISH_REASON_CANCELLED,
    FinishReason.ERROR: common_pb2.FINISH_REASON_ERROR,
}
STATUS_TO_PB = {s: common_pb2.ReplicaGroupStatus.Value(f"REPLICA_GROUP_STATUS_{s.name}") for s in GroupStatus}
DTYPE_TO_PB = {"float32": common_pb2.DTYPE_FLOAT32, "bfloat16": common_pb2.DTYPE_BFLOAT16,
               "float16": common_pb2.DTYPE_FLOAT16, "int8": common_pb2.DTYPE_INT8, "fp8": common_pb2.DTYPE_FP8}


# ---- protobuf <-> domain ------------------------------------------------------------------


def request_from_pb(pb: router_pb2.RouterGenerateRequest) -> GenerationRequest:
    s = pb.sampling
    sampling = SamplingSpec(
        temperature=s.temperature if s.HasField("temperature") else 1.0,
        top_p=s.top_p if s.HasField("top_p") else 1.0,
        top_k=s.top_k, seed=s.seed if s.HasField("seed") else None,
        max_tokens=s.max_tokens if s.HasField("max_tokens") else DEFAULT_MAX_TOKENS,
        stop=tuple(s.stop), stop_token_ids=tuple(s.stop_token_ids), logprobs=s.logprobs, ignore_eos=s.ignore_eos)
    which = pb.WhichOneof("prompt")
    return GenerationRequest(
        model=pb.model, request_id=pb.request_id, sampling=sampling,
        prompt_text=pb.text if which == "text" else None,
        prompt_ids=tuple(pb.token_ids.ids) if which == "token_ids" else None)


def token_to_pb(token: TokenOut) -> common_pb2.GeneratedToken:
    return common_pb2.GeneratedToken(
        index=token.index, token_id=token.token_id, text=token.text, logprob=token.logprob,
        top_logprobs=[common_pb2.TokenLogprob(token_id=a.token_id, text=a.text, logprob=a.logprob)
                      for a in token.top_logprobs])


def finished_to_pb(finished: Finished) -> common_pb2.GenerationFinished:
    t = finished.timings
    pb = common_pb2.GenerationFinished(
        finish_reason=FINISH_TO_PB[finished.reason],
        usage=common_pb2.Usage(prompt_tokens=finished.prompt_tokens, completion_tokens=finished.completion_tokens),
        timings=common_pb2.Timings(queue_ns=t.queue_ns, time_to_first_token_ns=t.time_to_first_token_ns,
                                   decode_ns=t.decode_ns, total_ns=t.total_ns))
    if finished.stop_sequence is not None:
        pb.stop_sequence = finished.stop_sequence
    return pb


def group_to_pb(view: ReplicaGroupView) -> router_pb2.ReplicaGroupInfo:
    return router_pb2.ReplicaGroupInfo(
        replica_group_id=view.replica_group_id, model=view.model, address=view.address,
        layout=common_pb2.ShardLayout(tp_degree=view.tp_degree, pp_degree=view.pp_degree,
                                      dtype=DTYPE_TO_PB.get(view.dtype, common_pb2.DTYPE_UNSPECIFIED)),
        kv_bytes_used=view.kv_bytes_used, kv_bytes_capacity=view.kv_bytes_capacity,
        kv_bytes_reserved=view.kv_bytes_reserved, kv_bytes_per_token=view.kv_bytes_per_token,
        status=STATUS_TO_PB[view.status], running=view.running, waiting=view.waiting,
        last_report_ms=view.last_report_ms)


class RouterServicer(router_pb2_grpc.RouterServiceServicer):
    """gRPC face of the router."""

    def __init__(self, core: RouterCore, auth: ApiKeyCheck) -> None:
        self.core = core
        self.auth = auth

    def Generate(self, request: router_pb2.RouterGenerateRequest,
                 context: grpc.ServicerContext) -> Iterator[router_pb2.RouterGenerateResponse]:
        self.auth.check_metadata(context.invocation_metadata())
        generation = self.core.generate(request_from_pb(request))
        context.add_callback(generation.cancel)  # client cancel or disconnect reaches the worker
        rid = generation.request_id
        try:
            for event in generation:
                if isinstance(event, TokenOut):
                    yield router_pb2.RouterGenerateResponse(request_id=rid, token=token_to_pb(event),
                                                            replica_group_id=generation.replica_group_id)
                else:
                    yield router_pb2.RouterGenerateResponse(request_id=rid, finished=finished_to_pb(event),
                                                            replica_group_id=generation.replica_group_id)
        except RequestCancelled:
            return  # the client cancelled or went away: nobody to answer

    def ListModels(self, request: router_pb2.ListModelsRequest,
                   context: grpc.ServicerContext) -> router_pb2.ListModelsResponse:
        self.auth.check_metadata(context.invocation_metadata())
        models = []
        for model in self.core.catalog:
            groups = self.core.groups(model.name)
            models.append(router_pb2.ModelInfo(
                name=model.name, max_model_len=model.max_model_len, vocab_size=model.vocab_size,
                replica_groups=len(groups), healthy_replica_groups=sum(g.status.routable for g in groups)))
        return router_pb2.ListModelsResponse(models=models)

    def ListReplicaGroups(self, request: router_pb2.ListReplicaGroupsRequest,
                          context: grpc.ServicerContext) -> router_pb2.ListReplicaGroupsResponse:
        self.auth.check_metadata(context.invocation_metadata())
        with self.core.replicas.lock:
            groups = [group_to_pb(v) for v in self.core.groups(request.model)]
        return router_pb2.ListReplicaGroupsResponse(groups=groups)


# ---- the process --------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("router")
    group.add_argument("--model", action="append", default=None, metavar="DIR",
                       help="model directory to serve (tokenizer, context, chat template); repeatable "
                            "(env SHARDLINE_MODEL)")
    group.add_argument("--served-model-name", action="append", default=None, metavar="NAME",
                       help="name clients use for the --model of the same position (default: the directory "
                            "name, as workers report it)")
    group.add_argument("--max-model-len", type=int, default=None,
                       help="longest prompt + completion accepted (default: the model's max_position_embeddings)")
    group.add_argument("--worker", action="append", default=None, metavar="HOST:PORT",
                       help="a replica group's WorkerService; repeatable (env SHARDLINE_WORKERS, comma-separated)")
    group.add_argument("--registry-url", default=None,
                       help="also discover groups from the shard registry's replica_groups.endpoint "
                            "(env SHARDLINE_REGISTRY_URL; default: only --worker)")
    group.add_argument("--redis-url", default=None,
                       help="shared health store (env SHARDLINE_REDIS_URL; default: in-process)")
    group.add_argument("--http-host", default=None, help="HTTP bind address (default: --host)")
    group.add_argument("--http-port", type=int, default=None,
                       help=f"OpenAI-compatible HTTP port, 0 for any, -1 for none "
                            f"(env SHARDLINE_HTTP_PORT; default {DEFAULT_HTTP_PORT})")
    group.add_argument("--telemetry-metrics-url", action="append", default=None, metavar="URL",
                       help="a service's /metrics to re-export on this router's /metrics (repeatable; env "
                            "SHARDLINE_TELEMETRY_METRICS_URL): the local stack's one scrape target")
    group.add_argument("--api-key", default=None,
                       help="require 'authorization: Bearer KEY' on gRPC and HTTP (env SHARDLINE_API_KEY)")
    group.add_argument("--max-queue", type=int, default=None,
                       help=f"requests that may wait for KV headroom, per model (env SHARDLINE_MAX_QUEUE; "
                            f"default {DEFAULT_MAX_QUEUE})")
    group.add_argument("--queue-timeout", type=float, default=None,
                       help=f"seconds a request may wait in the queue (env SHARDLINE_QUEUE_TIMEOUT_S; "
                            f"default {DEFAULT_MAX_WAIT_S:g})")
    group.add_argument("--poll-interval", type=float, default=None,
                       help=f"seconds between Stats polls of each group (default {DEFAULT_POLL_INTERVAL_S:g})")
    group.add_argument("--max-continuations", type=int, default=DEFAULT_MAX_CONTINUATIONS,
                       help="times a request may move to another group after its group fails mid-stream")


class RouterProcess:
    """Everything one router process runs besides the gRPC server: worker clients and their
    pollers, registry discovery, the HTTP front door."""

    def __init__(self, catalog: ModelCatalog, queue: QueueConfig, *, store: HealthStore, auth: ApiKeyCheck,
                 poll_interval_s: float = DEFAULT_POLL_INTERVAL_S,
                 max_continuations: int = DEFAULT_MAX_CONTINUATIONS) -> None:
        replicas = ReplicaSet()
        router = Router(replicas)
        admission = AdmissionQueue(replicas, router, queue)
        metrics = RouterMetrics()
        metrics.bind_queue_depth(admission.depth)
        self.clients: dict[str, WorkerClient] = {}
        self.core = RouterCore(catalog, replicas, router, admission, self._open_upstream, metrics=metrics,
                               max_continuations=max_continuations)
        self.store = store
        self.auth = auth
        self.poll_interval_s = poll_interval_s
        self.pollers: list[GroupPoller] = []
        self.discovery = None
        self.http = None
        self._stopped = False

    def _open_upstream(self, address: str, request_id: str, prompt_ids: list[int], sampling: SamplingSpec):
        return self.clients[address].generate(request_id, prompt_ids, sampling)

    def add_worker(self, address: str) -> None:
        """Route to the group at ``address`` from now on (polled first, so it is known at once)."""
        view, _created = self.core.replicas.add(address)
        if address in self.clients:
            return
        client = self.clients[address] = WorkerClient(address)
        metrics = self.core.metrics

        def on_update(v: ReplicaGroupView) -> None:
            if metrics is not None:
                metrics.group_reported(v.replica_group_id, v.kv_bytes_used, v.kv_bytes_capacity, v.kv_bytes_reserved)

        poller = GroupPoller(self.core.replicas, view, client, store=self.store, interval_s=self.poll_interval_s,
                             on_update=on_update)
        self.pollers.append(poller)
        poller.poll_once()
        poller.start()

    def start_discovery(self, registry_url: str) -> None:
        from services.router.discovery import RegistryDiscovery

        self.discovery = RegistryDiscovery(registry_url, self.core.replicas, self.add_worker).start()

    def start_http(self, host: str, port: int) -> int:
        from services.router.http_api import HttpServer, create_app

        self.http = HttpServer(create_app(self.core, self.auth), host, port).start()
        return self.http.port

    def stop(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        if self.http is not None:
            self.http.stop()
        if self.discovery is not None:
            self.discovery.stop()
        for poller in self.pollers:
            poller.stop()
        for client in self.clients.values():
            client.close()
        self.store.close()


def build_process(args: argparse.Namespace) -> RouterProcess:
    """The router's parts from its flags (env and defaults applied); raises ModelDirError or
    InvalidArgument for bad settings."""
    model_dirs = args.model or ([m] if (m := resolve("model", None, "")) else [])
    names = args.served_model_name or []
    if len(names) > len(model_dirs):
        raise InvalidArgument(f"{len(names)} --served-model-name for {len(model_dirs)} --model")
    catalog = ModelCatalog([load_served_model(d, name=names[i] if i < len(names) else None,
                                              max_model_len=args.max_model_len)
                            for i, d in enumerate(model_dirs)])
    queue = QueueConfig(max_size=resolve("max_queue", args.max_queue, DEFAULT_MAX_QUEUE),
                        max_wait_s=resolve("queue_timeout_s", args.queue_timeout, DEFAULT_MAX_WAIT_S))
    poll = args.poll_interval if args.poll_interval is not None else DEFAULT_POLL_INTERVAL_S
    if not 0 < poll <= 0.5:
        raise InvalidArgument(f"--poll-interval must be in (0, 0.5] seconds, got {poll}")
    if args.max_continuations < 0:
        raise InvalidArgument(f"--max-continuations must be >= 0, got {args.max_continuations}")
    return RouterProcess(catalog, queue, store=make_health_store(resolve("redis_url", args.redis_url, "") or None),
                         auth=ApiKeyCheck(resolve("api_key", args.api_key, "") or None), poll_interval_s=poll,
                         max_continuations=args.max_continuations)


def serve(args: argparse.Namespace) -> int:
    try:
        config = ServerConfig.from_args(args, service=SERVICE)
        process = build_process(args)
        http_port = resolve("http_port", args.http_port, DEFAULT_HTTP_PORT)
    except (ModelDirError, InvalidArgument) as exc:
        print(f"shardline serve router: {exc}", file=sys.stderr, flush=True)
        return 2
    configure_logging(config.log_level)
    upstreams = list(args.telemetry_metrics_url or [])
    upstreams += [u for u in resolve("telemetry_metrics_url", None, "").split(",") if u.strip()]
    if upstreams:
        from services.telemetry.federation import register_upstreams

        register_upstreams(upstreams)
    workers = list(args.worker or [])
    workers += [w.strip() for w in resolve("workers", None, "").split(",") if w.strip()]
    registry_url = resolve("registry_url", args.registry_url, "")
    try:
        # everything but the gRPC port first: a taken HTTP port fails the start, not a request
        for address in workers:
            process.add_worker(address)
        if registry_url:
            process.start_discovery(registry_url)
        if http_port >= 0:
            host = args.http_host or config.host
            try:
                port = process.start_http(host, http_port)
            except OSError as exc:
                log.error("cannot serve HTTP on %s:%d: %s", host, http_port, exc)
                return 1
            log.info("router OpenAI-compatible HTTP on http://%s:%d/v1", host, port)
        binding = ServiceBinding(full_name=router_pb2.DESCRIPTOR.services_by_name["RouterService"].full_name,
                                 servicer=RouterServicer(process.core, process.auth),
                                 add_to_server=router_pb2_grpc.add_RouterServiceServicer_to_server)
        return serve_service(args, service=SERVICE, bindings=lambda: [binding],
                             on_stopping=lambda _server: process.stop())
    finally:
        process.stop()
