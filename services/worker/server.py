"""WorkerService: token streaming, scoring, KV stats and draining for one replica group.

Served by the group's driver (global rank 0). A thin servicer: protobuf in, a call into the
engine, protobuf out; domain errors become statuses in ``services.common.grpc_server``. The
driver process also launches the group's other ranks (``services.worker.driver``). ``Relay``
multiplexes many generations on one stream, one message per engine step
(``services.worker.relay``); a thread per stream reads its submits and cancels. ``Generate``
streams one generation on a relay session of its own, so both RPCs take one path into the engine.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import threading
import time
import uuid
from collections.abc import Iterable, Iterator

import grpc

from services.common.config import resolve
from services.common.errors import FailedPrecondition, InvalidArgument, ShardlineError, Unavailable
from services.common.grpc_server import GrpcServer, ServiceBinding, serve_service, status_for
from services.common.proto import common_pb2, worker_pb2, worker_pb2_grpc
from services.common.proto_convert import FINISH_REASON_TO_PB, dtype_to_pb, sampling_from_pb
from services.common.sampling import FinishReason
from services.common.transport_security import TransportSecurity
from services.modeling.parallel.placement import PlacementError
from services.telemetry.client import ShipperConfig
from services.telemetry.observability import add_metrics_arguments, flush_observability, setup_observability
from services.telemetry.otel import current_metrics
from services.telemetry.tracing import traced_stream
from services.worker import multinode
from services.worker.driver import ReplicaDriver, ServingOptions, start_followers
from services.worker.engine.engine import ErrorEvent, FinishEvent
from services.worker.engine.step import TokenEvent
from services.worker.options import add_engine_arguments, add_layout_arguments, engine_spec
from services.worker.relay import RelaySession

SERVICE = "worker"
log = logging.getLogger(__name__)

def finished_pb(event) -> common_pb2.GenerationFinished:
    """An engine FinishEvent as the final message's payload."""
    return common_pb2.GenerationFinished(
        finish_reason=FINISH_REASON_TO_PB[event.reason],
        usage=common_pb2.Usage(prompt_tokens=event.prompt_tokens, completion_tokens=event.completion_tokens),
        timings=common_pb2.Timings(time_to_first_token_ns=max(0, event.first_token_ns), total_ns=event.total_ns))


def relay_response_pb(batch: list) -> worker_pb2.RelayResponse:
    """One engine step's events of a Relay stream's requests (``services.worker.relay``)."""
    response = worker_pb2.RelayResponse()
    add = response.events.add
    for relay_id, event in batch:
        pb = add(relay_id=relay_id)
        kind = event.__class__
        if kind is TokenEvent:
            token = pb.token  # present from the first field set, even to a default value
            token.token_id = event.token_id
            token.logprob = event.logprob
            if event.top_logprobs:
                token.top_logprobs.extend(common_pb2.TokenLogprob(token_id=t, logprob=lp)
                                          for t, lp in event.top_logprobs)
        elif kind is FinishEvent:
            pb.finished.CopyFrom(finished_pb(event))
        else:  # ErrorEvent (the group failed mid-generation) or Rejected (refused at submit)
            error = pb.error
            error.code = status_for(event.error).value[0]
            error.message = str(event.error)
            if kind is ErrorEvent:
                error.generated.SetInParent()  # present even when no token was produced
                error.generated.ids.extend(event.token_ids)
    return response


class WorkerServicer(worker_pb2_grpc.WorkerServiceServicer):
    """gRPC face of a replica group's engine (set once the group has loaded)."""

    def __init__(self) -> None:
        self.driver: ReplicaDriver | None = None
        self.ready = threading.Event()

    @property
    def engine(self):
        if not self.ready.is_set() or self.driver is None:
            raise Unavailable("the worker is still loading its shards")
        return self.driver.engine

    def _prompt_ids(self, request, field: str) -> list[int]:
        which = request.WhichOneof(field)
        if which == "text":
            if not request.text:
                raise InvalidArgument(f"{field}: text must not be empty")
            tokenizer = self.engine.tokenizer
            if tokenizer is None:
                raise FailedPrecondition("this model has no tokenizer.json: send token_ids")
            return tokenizer.encode(request.text).ids
        if which == "token_ids":
            if not request.token_ids.ids:
                raise InvalidArgument(f"{field}: token_ids must not be empty")
            return list(request.token_ids.ids)
        raise InvalidArgument(f"{field}: set text or token_ids (the {field} is empty)")

    @traced_stream("shardline.worker/Generate")
    def Generate(self, request: worker_pb2.GenerateRequest,
                 context: grpc.ServicerContext) -> Iterator[worker_pb2.GenerateResponse]:
        """One generation on a Relay session of its own: the engine path the router's streams
        take, one message per token. A refusal or a failed group ends the call with its status."""
        ids = self._prompt_ids(request, "prompt")
        params = sampling_from_pb(request.sampling)
        rid = request.request_id or f"req-{uuid.uuid4().hex[:12]}"
        session = RelaySession(self.engine)
        context.add_callback(session.close)  # client cancel or disconnect frees the blocks at once
        session.submit(0, ids, params, request_id=rid, reserve_kv=request.reserve_kv, texts=True)
        session.end_input()
        index = 0
        try:
            for batch in session.batches():
                for _, event in batch:
                    kind = event.__class__
                    if kind is FinishEvent:
                        yield worker_pb2.GenerateResponse(request_id=rid, finished=finished_pb(event))
                        return
                    if kind is not TokenEvent:  # Rejected, or ErrorEvent (the group failed)
                        raise event.error
                    yield worker_pb2.GenerateResponse(request_id=rid, token=common_pb2.GeneratedToken(
                        index=index, token_id=event.token_id, text=event.text, logprob=event.logprob,
                        top_logprobs=[common_pb2.TokenLogprob(token_id=t, logprob=lp)
                                      for t, lp in event.top_logprobs]))
                    index += 1
        finally:
            session.close()

    def Relay(self, request_iterator: Iterable[worker_pb2.RelayRequest],
              context: grpc.ServicerContext) -> Iterator[worker_pb2.RelayResponse]:
        session = RelaySession(self.engine)
        context.add_callback(session.close)  # the call ended or broke: its requests are cancelled
        threading.Thread(target=self._read_relay, args=(request_iterator, session), name="relay-reader",
                         daemon=True).start()
        try:
            for batch in session.batches():
                yield relay_response_pb(batch)
        finally:
            session.close()

    def _read_relay(self, requests: Iterable[worker_pb2.RelayRequest], session) -> None:
        """The Relay stream's reader thread: submits and cancels into the session."""
        try:
            for message in requests:
                command = message.WhichOneof("command")
                if command == "submit":
                    submit = message.submit
                    try:
                        ids = self._prompt_ids(submit.request, "prompt")
                        params = sampling_from_pb(submit.request.sampling)
                    except ShardlineError as exc:
                        session.reject(submit.relay_id, exc)
                        continue
                    session.submit(submit.relay_id, ids, params, request_id=submit.request.request_id,
                                   trace_context=dict(submit.trace_context), reserve_kv=submit.request.reserve_kv)
                elif command == "cancel":
                    cancel = message.cancel
                    stopped = cancel.reason == common_pb2.FINISH_REASON_STOP_SEQUENCE  # else: the client gave up
                    session.cancel(cancel.relay_id, FinishReason.STOP_SEQUENCE if stopped else FinishReason.CANCELLED)
                else:
                    raise InvalidArgument("Relay: a message without a command (submit or cancel)")
        except ShardlineError as exc:  # the client broke the protocol: fail the stream
            session.fail(exc)
        except grpc.RpcError:  # the call was cancelled or broke while we read
            session.close()
        except Exception:  # a bug: say so, and do not leave the stream's requests running
            log.exception("Relay stream reader failed")
            session.close()
        else:
            session.end_input()

    def Score(self, request: worker_pb2.ScoreRequest, context: grpc.ServicerContext) -> worker_pb2.ScoreResponse:
        ids = self._prompt_ids(request, "input")
        if len(ids) < 2:
            raise InvalidArgument(f"input: need at least 2 tokens to score, got {len(ids)}")
        t0 = time.perf_counter_ns()
        result = self.engine.score(ids, top_logprobs=request.top_logprobs)
        top = [common_pb2.TopLogprobs(alternatives=[common_pb2.TokenLogprob(token_id=t, logprob=lp) for t, lp in at])
               for at in result.top_logprobs]
        return worker_pb2.ScoreResponse(token_ids=ids, n_tokens=result.n_tokens, logprobs=result.logprobs,
                                        nll=result.nll, perplexity=result.perplexity,
                                        total_ns=time.perf_counter_ns() - t0, top_logprobs=top)

    def Stats(self, request: worker_pb2.StatsRequest, context: grpc.ServicerContext) -> worker_pb2.StatsResponse:
        engine = self.engine
        plan = engine.runner.rt.plan
        response = worker_pb2.StatsResponse(
            replica_group_id=self.driver.replica_group_id,
            layout=common_pb2.ShardLayout(tp_degree=plan.tp_degree, pp_degree=plan.pp_degree,
                                          dtype=dtype_to_pb(plan.dtype)),
            model_name=self.driver.options.model_name or plan.config.name, numerics=plan.numerics,
            quantize_lm_head=plan.quantize_lm_head, **engine.stats())
        if request.weights_identity:
            response.model_fingerprint = self.driver.weights_fingerprint
        metrics = current_metrics()
        if metrics is not None and metrics.metrics_port:
            response.metrics_port = metrics.metrics_port
        if request.prefix_cache_events and engine.prefix_events is not None:
            read = engine.prefix_events.read(request.prefix_cache_epoch, request.prefix_cache_after)
            response.prefix_cache_epoch, response.prefix_cache_seq = read.epoch, read.seq
            response.prefix_cache_snapshot = read.snapshot
            response.prefix_cache_events.extend(worker_pb2.PrefixCacheEvent(block_hash=name, removed=removed)
                                                for name, removed in read.events)
        return response

    def Drain(self, request: worker_pb2.DrainRequest, context: grpc.ServicerContext) -> worker_pb2.DrainResponse:
        engine = self.engine
        engine.draining = True
        deadline = time.monotonic() + request.timeout_ns / 1e9
        while engine.in_flight_requests and time.monotonic() < deadline:
            time.sleep(0.05)
        in_flight = engine.in_flight_requests
        return worker_pb2.DrainResponse(drained=in_flight == 0, in_flight=in_flight)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_layout_arguments(parser)
    add_engine_arguments(parser)
    parser.add_argument("--advertise-address", default=None,
                        help="HOST:PORT others dial to reach this worker, recorded in the registry "
                             "(env SHARDLINE_ADVERTISE_ADDRESS; default: the bind address)")
    parser.add_argument("--registry-url", default=None,
                        help="shard registry URL (env SHARDLINE_REGISTRY_URL; default: none)")
    parser.add_argument("--await-rotation", action="store_true",
                        help="stay 'provisioning' in the registry once loaded: a fleet controller made the "
                             "group's row and puts it in rotation after its checks")
    parser.add_argument("--redis-url", default=None,
                        help="health store (env SHARDLINE_REDIS_URL; default: none, routers poll Stats)")
    parser.add_argument("--telemetry", default=None, metavar="ADDRESS",
                        help="telemetry service host:port every rank ships its CollectiveEvents to "
                             "(env SHARDLINE_TELEMETRY_ADDR; default: none)")
    parser.add_argument("--telemetry-sample", default=None, metavar="OP=RATE,...",
                        help="per-op sampling of shipped events, e.g. broadcast=0.1; timeouts are always kept "
                             "(env SHARDLINE_TELEMETRY_SAMPLE; default: every event)")
    add_metrics_arguments(parser, default_port=0)  # vLLM's metric names among ours: scraped like a vLLM server
    multinode.add_arguments(parser)


def serve(args: argparse.Namespace) -> int:
    if multinode.wants_launch(args):
        return multinode.launch(args)  # becomes torchrun, which runs this command once per local rank
    rank = os.environ.get("RANK", "0") or "0"
    external = multinode.under_launch()
    if external:
        try:
            multinode.check(args)
        except PlacementError as exc:
            print(f"shardline serve worker: refused: {exc}", flush=True)
            return 2
    elif rank != "0":
        # Outside torchrun a worker is its group's driver (rank 0) and starts its follower ranks
        # itself, on this host. Serving as rank N of a group whose driver is elsewhere would start
        # a second driver under the same group id: refuse instead.
        print(f"shardline serve worker: RANK={rank} of WORLD_SIZE={os.environ.get('WORLD_SIZE', '?')} "
              f"(MASTER_ADDR={os.environ.get('MASTER_ADDR', '?')}) outside torchrun: a worker serves as its group's "
              f"rank 0 and spawns its followers on its own host; for ranks on several hosts, start each host with "
              f"--nnodes N --node-rank R --rdzv-endpoint HOST:PORT (or under torchrun)", flush=True)
        return 2
    args.model = resolve("model", args.model, "") or None
    args.checkpoint = resolve("checkpoint", args.checkpoint, "") or None
    if not args.model and not args.checkpoint:
        print("shardline serve worker: --model DIR or --checkpoint MANIFEST (or SHARDLINE_MODEL / "
              "SHARDLINE_CHECKPOINT) is required", flush=True)
        return 2
    if args.replica_group_id == "local":
        args.replica_group_id = f"rg-{uuid.uuid4().hex[:8]}"
    servicer = WorkerServicer()
    spec = engine_spec(args)  # a bad layout fails here, before anything starts
    try:
        telemetry = ShipperConfig.from_settings(args.telemetry, args.telemetry_sample,
                                                security=TransportSecurity.from_args(args))
    except ValueError as exc:  # a bad sampling spec or buffer size
        print(f"shardline serve worker: {exc}", flush=True)
        return 2

    if external and rank != "0":
        health_url = resolve("redis_url", args.redis_url, "") or None
        return _exit(multinode.run_follower(int(rank), spec, telemetry, health_url))
    # the follower ranks fork from this process now, before the gRPC server starts its threads
    followers = start_followers(spec, telemetry, fork=True) if spec.plan.world_size > 1 and not external else None

    def on_started(server: GrpcServer) -> None:
        options = ServingOptions(registry_url=resolve("registry_url", args.registry_url, "") or None,
                                 health_url=resolve("redis_url", args.redis_url, "") or None,
                                 endpoint=resolve("advertise_address", args.advertise_address, "") or server.address,
                                 model_name=args.served_model_name or "",
                                 telemetry=telemetry, await_rotation=args.await_rotation,
                                 external_followers=external)
        setup_observability(args, SERVICE)
        servicer.driver = ReplicaDriver(spec, options, followers=followers)
        servicer.driver.start()
        servicer.ready.set()
        server.set_serving(True)
        threading.Thread(target=_watch, args=(servicer, server), daemon=True).start()

    def on_stopping(server: GrpcServer) -> None:
        if servicer.driver is not None:
            servicer.driver.stop()

    binding = ServiceBinding(full_name=worker_pb2.DESCRIPTOR.services_by_name["WorkerService"].full_name,
                             servicer=servicer, add_to_server=worker_pb2_grpc.add_WorkerServiceServicer_to_server)
    try:
        code = serve_service(args, service=SERVICE, bindings=lambda: [binding], start_serving=False,
                             on_started=on_started, on_stopping=on_stopping)
    except Exception:  # noqa: BLE001 - loading failed (a bad shard, a rank that died): say why, exit 1
        log.exception("worker %s failed to start", args.replica_group_id)
        code = 1
    if followers is not None and not servicer.ready.is_set():
        followers.join(timeout_s=0.1)  # never served (no port, a failed load): the driver did not stop them
    return _exit(code)


def _exit(code: int) -> int:
    """The group is stopped and its followers joined. A process group whose peer died still holds
    gloo work that its destructor would wait on forever at interpreter exit, and a telemetry
    stream still open keeps gRPC's threads busy: leave now, once the spans and metrics not yet
    exported are sent."""
    flush_observability()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _watch(servicer: WorkerServicer, server: GrpcServer) -> None:
    """Health turns NOT_SERVING as soon as the group fails."""
    while servicer.driver is not None and servicer.driver.healthy:
        time.sleep(0.2)
    if servicer.driver is not None and servicer.driver.engine is not None and servicer.driver.engine.failure:
        server.set_serving(False)
