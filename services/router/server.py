"""RouterService: the client-facing front door (admission, KV-headroom routing, streaming).

A thin servicer: protobuf in, a call into the router's domain modules (``service.py``,
``routing.py``, ``admission.py``, ``replicas.py``), protobuf out; domain errors become statuses
in ``services.common.grpc_aio_server``. The servicer runs on grpc.aio: every stream is a
coroutine on the process's one event loop, which also serves the OpenAI-compatible HTTP API
(``http_api.py``) on ``--http-port`` and holds the worker streams being relayed (the pollers
that fetch every replica group's Stats are threads; ``process.py``).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys

import grpc

from services.common.config import ServerConfig, resolve
from services.common.errors import InvalidArgument
from services.common.group_status import GroupStatus
from services.common.grpc_aio_server import serve_until_signal
from services.common.grpc_server import ServiceBinding
from services.common.logging import configure_logging
from services.common.proto import common_pb2, router_pb2, router_pb2_grpc
from services.common.proto_convert import FINISH_REASON_TO_PB, dtype_to_pb, sampling_from_pb
from services.router.admission import DEFAULT_MAX_QUEUE, DEFAULT_MAX_WAIT_S, RequestCancelled
from services.router.auth import ApiKeyCheck
from services.router.catalog import ModelDirError
from services.router.edge import DEFAULT_MAX_BODY_BYTES
from services.router.process import SHADOW_CONFIG_FIELDS, RouterProcess, build_process
from services.router.replicas import DEFAULT_POLL_INTERVAL_S, ReplicaGroupView
from services.router.service import DEFAULT_MAX_CONTINUATIONS, RouterCore
from services.router.shadow import DEFAULT_IDLE_WAIT_S, JUDGES
from services.router.shadow import DEFAULT_MIN_TOKENS as DEFAULT_SHADOW_MIN_TOKENS
from services.router.shadow import DEFAULT_QUEUE_SIZE as DEFAULT_SHADOW_QUEUE
from services.router.shadow import DEFAULT_THRESHOLD_PCT as DEFAULT_SHADOW_THRESHOLD_PCT
from services.router.shadow import DEFAULT_WINDOW_TOKENS as DEFAULT_SHADOW_WINDOW
from services.router.tools import DEFAULT_PARSER, PARSERS
from services.router.types import Finished, GenerationRequest, TokenOut, trace_context_of
from services.telemetry.federation import register_upstreams

SERVICE = "router"
DEFAULT_HTTP_PORT = 8000
log = logging.getLogger(__name__)

STATUS_TO_PB = {s: common_pb2.ReplicaGroupStatus.Value(f"REPLICA_GROUP_STATUS_{s.name}") for s in GroupStatus}


# ---- protobuf <-> domain ------------------------------------------------------------------


def request_from_pb(pb: router_pb2.RouterGenerateRequest,
                    trace_context: tuple[tuple[str, str], ...] = ()) -> GenerationRequest:
    sampling = sampling_from_pb(pb.sampling)
    which = pb.WhichOneof("prompt")
    return GenerationRequest(
        model=pb.model, request_id=pb.request_id, sampling=sampling,
        prompt_text=pb.text if which == "text" else None,
        prompt_ids=tuple(pb.token_ids.ids) if which == "token_ids" else None, trace_context=trace_context)


def token_response(request_id: str, replica_group_id: str, token: TokenOut) -> router_pb2.RouterGenerateResponse:
    """One token's message, its fields set in place (no nested message built and copied)."""
    response = router_pb2.RouterGenerateResponse(request_id=request_id, replica_group_id=replica_group_id)
    pb = response.token  # marked present by the first field set, even to a default value
    pb.index = token.index
    pb.token_id = token.token_id
    pb.text = token.text
    pb.logprob = token.logprob
    if token.top_logprobs:
        pb.top_logprobs.extend(common_pb2.TokenLogprob(token_id=a.token_id, text=a.text, logprob=a.logprob)
                               for a in token.top_logprobs)
    return response


def finished_to_pb(finished: Finished) -> common_pb2.GenerationFinished:
    t = finished.timings
    pb = common_pb2.GenerationFinished(
        finish_reason=FINISH_REASON_TO_PB[finished.reason],
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
                                      dtype=dtype_to_pb(view.dtype)),
        kv_bytes_used=view.kv_bytes_used, kv_bytes_capacity=view.kv_bytes_capacity,
        kv_bytes_reserved=view.kv_bytes_reserved, kv_bytes_per_token=view.kv_bytes_per_token,
        status=STATUS_TO_PB[view.status], running=view.running, waiting=view.waiting,
        last_report_ms=view.last_report_ms, kv_bytes_committed=max(0, view.committed_bytes))


class RouterServicer(router_pb2_grpc.RouterServiceServicer):
    """gRPC face of the router (grpc.aio: each RPC is a coroutine on the router's event loop)."""

    def __init__(self, core: RouterCore, auth: ApiKeyCheck) -> None:
        self.core = core
        self.auth = auth

    async def Generate(self, request: router_pb2.RouterGenerateRequest, context: grpc.aio.ServicerContext) -> None:
        metadata = context.invocation_metadata()
        self.auth.check_metadata(metadata)
        generation = await self.core.generate(request_from_pb(request, trace_context_of(metadata)))
        rid = generation.request_id
        write = context.write
        try:
            async for event in generation:
                if event.__class__ is TokenOut:
                    await write(token_response(rid, generation.replica_group_id, event))
                else:
                    await write(router_pb2.RouterGenerateResponse(request_id=rid, finished=finished_to_pb(event),
                                                                  replica_group_id=generation.replica_group_id))
        except RequestCancelled:
            return  # the client cancelled or went away: nobody to answer
        finally:
            generation.close()  # a client cancel (this task cancelled) reaches the worker here

    async def Score(self, request: router_pb2.RouterScoreRequest,
                    context: grpc.aio.ServicerContext) -> router_pb2.RouterScoreResponse:
        metadata = context.invocation_metadata()
        self.auth.check_metadata(metadata)
        which = request.WhichOneof("prompt")
        scored = await self.core.score(GenerationRequest(
            model=request.model, request_id=request.request_id, prompt_text=request.text if which == "text" else None,
            prompt_ids=tuple(request.token_ids.ids) if which == "token_ids" else None,
            trace_context=trace_context_of(metadata)), request.top_logprobs)
        return router_pb2.RouterScoreResponse(
            request_id=scored.request_id, replica_group_id=scored.replica_group_id,
            tokens=[common_pb2.TokenLogprob(token_id=t, text=text) for t, text in zip(scored.token_ids,
                                                                                      scored.token_texts)],
            logprobs=scored.logprobs, nll=scored.nll, perplexity=scored.perplexity,
            top_logprobs=[common_pb2.TopLogprobs(alternatives=[
                common_pb2.TokenLogprob(token_id=a.token_id, text=a.text, logprob=a.logprob) for a in at])
                for at in scored.top_logprobs])

    async def ListModels(self, request: router_pb2.ListModelsRequest,
                         context: grpc.aio.ServicerContext) -> router_pb2.ListModelsResponse:
        self.auth.check_metadata(context.invocation_metadata())
        models = []
        for model in self.core.catalog:
            groups = self.core.groups(model.name)
            models.append(router_pb2.ModelInfo(
                name=model.name, max_model_len=model.max_model_len, vocab_size=model.vocab_size,
                replica_groups=len(groups), healthy_replica_groups=sum(g.status.routable for g in groups)))
        return router_pb2.ListModelsResponse(models=models)

    async def ListReplicaGroups(self, request: router_pb2.ListReplicaGroupsRequest,
                                context: grpc.aio.ServicerContext) -> router_pb2.ListReplicaGroupsResponse:
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
    group.add_argument("--chat-template", action="append", default=None, metavar="FILE",
                       help="a Jinja chat template for the --model of the same position, instead of its own "
                            "(chat_template.jinja or tokenizer_config.json's chat_template)")
    group.add_argument("--tool-call-parser", choices=PARSERS, default=DEFAULT_PARSER,
                       help="how tool calls are read from a model's text under tool_choice auto: hermes "
                            "(<tool_call>{...}</tool_call>) or llama3_json (a bare JSON call); default hermes")
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
    group.add_argument("--metrics-auth", action="store_const", const=True, default=None,
                       help="/metrics requires the API key too (env SHARDLINE_METRICS_AUTH; default: open, "
                            "for a scraper on a private network)")
    group.add_argument("--max-queue", type=int, default=None,
                       help=f"requests that may wait for KV headroom, per model (env SHARDLINE_MAX_QUEUE; "
                            f"default {DEFAULT_MAX_QUEUE})")
    group.add_argument("--queue-timeout", type=float, default=None,
                       help=f"seconds a request may wait in the queue (env SHARDLINE_QUEUE_TIMEOUT_S; "
                            f"default {DEFAULT_MAX_WAIT_S:g})")
    group.add_argument("--poll-interval", type=float, default=None,
                       help=f"seconds between Stats polls of each group (default {DEFAULT_POLL_INTERVAL_S:g})")
    group.add_argument("--routing", choices=("prefix", "kv"), default="prefix",
                       help="prefix (default): among the groups with KV headroom for a request, the one whose "
                            "prefix cache holds most of its prompt, unless much busier; kv: the least utilized")
    group.add_argument("--max-body-bytes", type=int, default=None,
                       help=f"largest HTTP request body accepted, larger ones get 413 (env "
                            f"SHARDLINE_MAX_BODY_BYTES; default {DEFAULT_MAX_BODY_BYTES})")
    group.add_argument("--max-continuations", type=int, default=DEFAULT_MAX_CONTINUATIONS,
                       help="times a request may move to another group after its group fails mid-stream")
    group.add_argument("--telemetry", default=None, metavar="HOST:PORT",
                       help="telemetry service the shadow divergence alerts go to (env SHARDLINE_TELEMETRY_ADDR)")
    add_shadow_arguments(parser)


def add_shadow_arguments(parser: argparse.ArgumentParser) -> None:
    """The shadow traffic flags (``shardline up`` passes them on to its router)."""
    group = parser.add_argument_group("shadow traffic")
    group.add_argument("--shadow-fraction", type=float, default=None, metavar="F",
                       help="share of finished requests mirrored to candidate groups, scored there on the "
                            "incumbent's tokens (default 0: off)")
    group.add_argument("--shadow-group", action="append", default=None, metavar="ID",
                       help="a candidate replica group id; repeatable (default: every other group of the model "
                            "whose plan, dtype/tp/pp, differs from the incumbent's)")
    group.add_argument("--shadow-threshold-pct", type=float, default=None, metavar="PCT",
                       help=f"|perplexity delta| of a pair's window that raises a divergence alert on the "
                            f"candidate (default {DEFAULT_SHADOW_THRESHOLD_PCT:g})")
    group.add_argument("--shadow-queue", type=int, default=None, metavar="N",
                       help=f"finished requests waiting to be mirrored; more are dropped and counted "
                            f"(default {DEFAULT_SHADOW_QUEUE})")
    group.add_argument("--shadow-window-tokens", type=int, default=None, metavar="N",
                       help=f"mirrored tokens in each pair's rolling window (default {DEFAULT_SHADOW_WINDOW})")
    group.add_argument("--shadow-min-tokens", type=int, default=None, metavar="N",
                       help=f"tokens a window needs before it is judged (default {DEFAULT_SHADOW_MIN_TOKENS})")
    group.add_argument("--shadow-seed", type=int, default=None, help="seed of the pick of mirrored requests")
    group.add_argument("--shadow-idle-wait", type=float, default=None, metavar="S",
                       help=f"seconds a mirrored request waits for its groups to have none of this router's "
                            f"requests in flight (a Score between engine steps delays every stream there) before "
                            f"it is dropped and counted; 0 scores at once (default {DEFAULT_IDLE_WAIT_S:g})")
    group.add_argument("--shadow-judge", choices=JUDGES, default=None,
                       help="the window a pair's alert is judged on: 'prompt' (default: the prompt's tokens, "
                            "which the incumbent scores too; unbiased) or 'generated' (the incumbent's own "
                            "tokens: its choices favour it, so the delta reads high)")


SHADOW_FLAGS = tuple(SHADOW_CONFIG_FIELDS)  # the value flags; --shadow-group is repeatable


def shadow_flags(args: argparse.Namespace) -> list[str]:
    """The shadow flags set in ``args``, as a router command line takes them."""
    flags = []
    for name in SHADOW_FLAGS:
        if (value := getattr(args, name, None)) is not None:
            flags += [f"--{name.replace('_', '-')}", str(value)]
    for group_id in getattr(args, "shadow_group", None) or ():
        flags += ["--shadow-group", group_id]
    return flags


# Python's default is 5 ms: the longest the loop waits for the GIL while a prepare thread works
LOOP_GIL_SWITCH_S = 0.001


def serve(args: argparse.Namespace) -> int:
    try:
        config = ServerConfig.from_args(args, service=SERVICE)
        process = build_process(args)
        http_port = resolve("http_port", args.http_port, DEFAULT_HTTP_PORT)
    except (ModelDirError, InvalidArgument) as exc:
        print(f"shardline serve router: {exc}", file=sys.stderr, flush=True)
        return 2
    configure_logging(config.log_level)
    # the event loop relays every stream's tokens; a prepare thread parsing or templating a large
    # request holds the GIL between its switch points, and the loop waits up to this long for it
    sys.setswitchinterval(LOOP_GIL_SWITCH_S)
    upstreams = list(args.telemetry_metrics_url or [])
    upstreams += [u for u in resolve("telemetry_metrics_url", None, "").split(",") if u.strip()]
    if upstreams:
        register_upstreams(upstreams, security=process.security)
    workers = list(args.worker or [])
    workers += [w.strip() for w in resolve("workers", None, "").split(",") if w.strip()]
    registry_url = resolve("registry_url", args.registry_url, "")
    return asyncio.run(_serve(config, process, workers=workers, registry_url=registry_url,
                              http_host=args.http_host or config.host, http_port=http_port))


async def _serve(config: ServerConfig, process: RouterProcess, *, workers: list[str], registry_url: str,
                 http_host: str, http_port: int) -> int:
    try:
        # everything but the gRPC port first: a taken HTTP port fails the start, not a request
        for address in workers:
            process.add_worker(address)
        if registry_url:
            process.start_discovery(registry_url)
        if http_port >= 0:
            try:
                port = await process.start_http(http_host, http_port)
            except OSError as exc:
                log.error("cannot serve HTTP on %s:%d: %s", http_host, http_port, exc)
                return 1
            scheme = "https" if process.security.serves_tls else "http"
            log.info("router OpenAI-compatible HTTP on %s://%s:%d/v1", scheme, http_host, port)
        binding = ServiceBinding(full_name=router_pb2.DESCRIPTOR.services_by_name["RouterService"].full_name,
                                 servicer=RouterServicer(process.core, process.auth),
                                 add_to_server=router_pb2_grpc.add_RouterServiceServicer_to_server)
        return await serve_until_signal(config, [binding], on_stopping=lambda _server: process.stop(),
                                        security=process.security)
    finally:
        await process.close()
