"""One way to run a shardline gRPC service: bind, health, reflection, error mapping, shutdown.

Every service's ``server.py`` builds its servicer and hands it to :func:`run_until_signal`, so
all six (router, worker, planner, loader, telemetry, fleet) behave alike:

- the standard ``grpc.health.v1.Health`` service answers SERVING for the overall server ("")
  and for each shardline service by its full name, and NOT_SERVING once shutdown starts, so a
  load balancer stops sending work before the port closes;
- reflection lists the services in ``--dev`` (``grpcurl -plaintext 127.0.0.1:50053 list``), and is
  off otherwise: it tells anyone who reaches the port every method it has;
- TLS and the internal token as :mod:`services.common.transport_security` says;
- :class:`ErrorInterceptor` turns a :class:`~services.common.errors.ShardlineError` raised by a
  handler into its status code through :data:`STATUS_FOR_ERROR`, so servicers stay thin
  (protobuf in, domain call, protobuf out) and never translate errors by hand;
- SIGTERM/SIGINT: health NOT_SERVING, ``server.stop(grace)`` lets in-flight RPCs finish, exit 0.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from concurrent import futures
from dataclasses import dataclass, field
from typing import Any, NoReturn

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from services.common import heap
from services.common.config import ServerConfig
from services.common.errors import ERROR_CLASSES, InvalidArgument, ShardlineError
from services.common.logging import configure_logging
from services.common.stop_signals import SignalListener
from services.common.transport_security import INTERNAL_SERVICES, TokenInterceptor, TransportSecurity

log = logging.getLogger(__name__)

# The only place a domain exception becomes a gRPC status, so every service maps an error alike.
STATUS_FOR_ERROR: dict[type[ShardlineError], grpc.StatusCode] = {
    cls: grpc.StatusCode[cls.grpc_status] for cls in ERROR_CLASSES}


# Clients keep long-lived streams open (a router's Relay stream to each worker) and ping them
# every 10 s to notice a dead peer; grpc's default policy answers pings more often than every
# 5 minutes on a stream without data with GOAWAY ("too_many_pings"), which would break an idle
# Relay stream every ~30 s.
KEEPALIVE_POLICY = [("grpc.http2.min_ping_interval_without_data_ms", 5_000),
                    ("grpc.keepalive_permit_without_calls", 1)]
# Every server, sync or aio: grpc enables SO_REUSEPORT by default, so a second server on a taken
# port would start "fine" and steal half the connections; fail loudly instead.
SERVER_OPTIONS = [("grpc.so_reuseport", 0), *KEEPALIVE_POLICY]
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1", "[::1]")


def register_services(server: Any, bindings: list[ServiceBinding], health_servicer: Any, *,
                      with_reflection: bool) -> tuple[str, ...]:
    """Add ``bindings``, health and (in ``--dev``) reflection to a sync or aio ``server``; the
    services' names."""
    for binding in bindings:
        binding.add_to_server(binding.servicer, server)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = tuple(b.full_name for b in bindings)
    if with_reflection:
        reflection.enable_server_reflection((*names, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    return names


def warn_if_exposed(config: ServerConfig, security: TransportSecurity) -> None:
    """A port off loopback with neither TLS nor a credential is worth a line in the log."""
    if config.host in LOOPBACK_HOSTS:
        return
    if not security.serves_tls:
        log.warning("%s listens on %s without TLS (--tls-cert/--tls-key)", config.service, config.address)
    if config.service in INTERNAL_SERVICES and security.internal_token is None and not security.mtls:
        log.warning("%s listens on %s and anyone who reaches it may call it: set SHARDLINE_INTERNAL_TOKEN "
                    "or --mtls", config.service, config.address)


def status_for(exc: ShardlineError) -> grpc.StatusCode:
    """The status of the most specific mapped class in ``exc``'s MRO, so a subclass such as a
    ``CheckpointLayoutError(FailedPrecondition)`` needs no entry of its own."""
    for cls in type(exc).__mro__:
        code = STATUS_FOR_ERROR.get(cls)  # type: ignore[arg-type]
        if code is not None:
            return code
    return grpc.StatusCode.INTERNAL


def _abort(context: grpc.ServicerContext, exc: ShardlineError) -> NoReturn:
    code = status_for(exc)
    log.info("%s: %s", code.name, exc)
    context.abort(code, str(exc))
    raise AssertionError("unreachable: context.abort raises")  # pragma: no cover


class ErrorInterceptor(grpc.ServerInterceptor):
    """Wraps every handler so that a ShardlineError becomes ``context.abort(code, message)``.

    Other exceptions are left to grpc, which logs them with a traceback and answers UNKNOWN:
    they are bugs, and a bug should not be dressed up as a client error.
    """

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler | None],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = continuation(handler_call_details)
        return None if handler is None else rewrap_handler(handler, _wrap_unary, _wrap_stream)


def rewrap_handler(handler: grpc.RpcMethodHandler, wrap_unary_response: Callable[[Any], Any],
                   wrap_stream_response: Callable[[Any], Any]) -> grpc.RpcMethodHandler:
    """The same handler with its behaviour wrapped: ``wrap_unary_response`` for the kinds that
    answer one message, ``wrap_stream_response`` for the kinds that stream (sync and aio servers)."""
    kwargs = {"request_deserializer": tolerant_deserializer(handler.request_deserializer),
              "response_serializer": handler.response_serializer}
    if handler.unary_unary is not None:
        return grpc.unary_unary_rpc_method_handler(wrap_unary_response(handler.unary_unary), **kwargs)
    if handler.unary_stream is not None:
        return grpc.unary_stream_rpc_method_handler(wrap_stream_response(handler.unary_stream), **kwargs)
    if handler.stream_unary is not None:
        return grpc.stream_unary_rpc_method_handler(wrap_unary_response(handler.stream_unary), **kwargs)
    if handler.stream_stream is not None:
        return grpc.stream_stream_rpc_method_handler(wrap_stream_response(handler.stream_stream), **kwargs)
    return handler


class UndecodableRequest:
    """What :func:`tolerant_deserializer` hands the handler for bytes that are not the request
    message: grpc would answer a deserializer's exception with UNKNOWN (aio) or INTERNAL (sync),
    a server fault, so the wrappers turn this into INVALID_ARGUMENT instead, the client's."""

    __slots__ = ("message",)

    def __init__(self, message: str) -> None:
        self.message = message


def tolerant_deserializer(deserialize: Callable[[bytes], Any] | None) -> Callable[[bytes], Any] | None:
    if deserialize is None:
        return None
    cls = getattr(deserialize, "__self__", None)
    name = getattr(getattr(cls, "DESCRIPTOR", None), "full_name", "request")

    def deserialize_or_mark(data: bytes) -> Any:
        try:
            return deserialize(data)
        except Exception as exc:  # noqa: BLE001 - protobuf's DecodeError, or whatever a deserializer raises
            return UndecodableRequest(f"the request ({len(data)} bytes) is not a valid {name} message: {exc}")

    return deserialize_or_mark


def checked_request(request: Any) -> Any:
    """``request`` if it decoded; InvalidArgument if not. A request stream comes back wrapped,
    raising at the message that did not decode."""
    if request.__class__ is UndecodableRequest:
        raise InvalidArgument(request.message)
    if hasattr(request, "__anext__"):
        return _checked_async_stream(request)
    if hasattr(request, "__next__"):
        return (checked_request(r) for r in request)
    return request


async def _checked_async_stream(requests: Any) -> Any:
    async for request in requests:
        yield checked_request(request)


def host_port(host: str, port: int) -> str:
    """``host:port``, with an IPv6 host in brackets."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _wrap_unary(behavior: Callable[[Any, grpc.ServicerContext], Any]) -> Callable[..., Any]:
    def wrapped(request: Any, context: grpc.ServicerContext) -> Any:
        try:
            return behavior(checked_request(request), context)
        except ShardlineError as exc:
            _abort(context, exc)

    return wrapped


def _wrap_stream(behavior: Callable[[Any, grpc.ServicerContext], Iterator[Any]]) -> Callable[..., Any]:
    # Errors of a streaming handler surface while its iterator is consumed, not when it is
    # called, so the wrapper must itself iterate.
    def wrapped(request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
        try:
            yield from behavior(checked_request(request), context)
        except ShardlineError as exc:
            _abort(context, exc)

    return wrapped



@dataclass(frozen=True)
class ServiceBinding:
    """A servicer with the generated function that registers it and its full proto name
    (e.g. ``shardline.v1.PlannerService``), which health and reflection report."""

    full_name: str
    servicer: object
    add_to_server: Callable[[Any, grpc.Server], None]


class BindError(OSError):
    """The port could not be bound (in use, or a host this machine does not have)."""


@dataclass
class GrpcServer:
    """A started grpc server with its health servicer. Build with :func:`start_server`."""

    config: ServerConfig
    server: grpc.Server
    health: health.HealthServicer
    port: int
    service_names: tuple[str, ...]
    _stopped: threading.Event = field(default_factory=threading.Event)

    @property
    def address(self) -> str:
        return host_port(self.config.host, self.port)

    def set_serving(self, serving: bool) -> None:
        """Overall and per-service health. Services that load something slow (a worker loading
        its shard) call this with False until they are ready."""
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in (health.OVERALL_HEALTH, *self.service_names):
            self.health.set(name, status)

    def stop(self, grace_s: float | None = None) -> None:
        """NOT_SERVING first (health watchers see it before the port closes), then stop with
        grace; returns once every in-flight RPC has finished or the grace ran out."""
        if self._stopped.is_set():
            return
        self._stopped.set()
        self.health.enter_graceful_shutdown()
        grace = self.config.grace_s if grace_s is None else grace_s
        self.server.stop(grace).wait()


def start_server(config: ServerConfig, bindings: list[ServiceBinding], *, start_serving: bool = True,
                 security: TransportSecurity | None = None) -> GrpcServer:
    """Bind ``config.address`` (TLS and the internal token as ``security`` says), register the
    services, health and reflection, and start. Health says SERVING at once unless
    ``start_serving`` is False."""
    security = security or TransportSecurity()
    token = security.required_token(config.service)
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=config.max_workers, thread_name_prefix=f"{config.service}-rpc"),
        interceptors=[*([TokenInterceptor(token)] if token else []), ErrorInterceptor()],
        options=SERVER_OPTIONS,
    )
    health_servicer = health.HealthServicer(
        experimental_non_blocking=True,
        experimental_thread_pool=futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="health"),
    )
    names = register_services(server, bindings, health_servicer, with_reflection=config.reflection)
    warn_if_exposed(config, security)
    try:
        port = security.bind(server, config.address, service=config.service)
    except RuntimeError as exc:
        server.stop(None)
        raise BindError(f"cannot bind {config.address} for {config.service}: {exc}") from exc
    if port == 0:  # older grpc versions return 0 instead of raising
        server.stop(None)
        raise BindError(f"cannot bind {config.address} for {config.service} (port in use?)")
    server.start()
    running = GrpcServer(config=config, server=server, health=health_servicer, port=port, service_names=names)
    running.set_serving(start_serving)
    return running


def run_until_signal(
    config: ServerConfig,
    bindings: list[ServiceBinding],
    *,
    start_serving: bool = True,
    on_started: Callable[[GrpcServer], None] | None = None,
    on_stopping: Callable[[GrpcServer], None] | None = None,
    security: TransportSecurity | None = None,
) -> int:
    """Serve until SIGTERM or SIGINT, then shut down gracefully and return 0 (the exit code).

    ``start_serving=False`` keeps health NOT_SERVING until the service calls
    ``set_serving(True)`` (a worker loading its shards). ``on_started`` runs once the port is
    bound (e.g. to load, register with the registry, then turn SERVING); ``on_stopping`` runs
    after health turns NOT_SERVING and before the server stops (e.g. to drain). A signal that
    arrives during start-up still shuts down gracefully; a second signal stops at once.
    """
    stop_requested = threading.Event()
    running: GrpcServer | None = None

    def on_signal(signum: int) -> None:  # on the signal listener's thread
        name = signal.Signals(signum).name
        if stop_requested.is_set():
            log.warning("second %s: stopping without grace", name)
            if running is not None:
                running.server.stop(0)
            return
        log.info("%s: shutting down (grace %.1f s)", name, config.grace_s)
        stop_requested.set()

    with SignalListener(on_signal):
        try:
            running = start_server(config, bindings, start_serving=start_serving, security=security)
        except BindError as exc:
            log.error("%s", exc)
            return 1
        log.info("%s serving %s on %s", config.service, ", ".join(running.service_names), running.address)
        if on_started is not None and not stop_requested.is_set():
            on_started(running)
        heap.started()
        # a timed wait, so that the main thread returns to the interpreter, where the signal
        # handler runs, whatever the platform's lock semantics
        while not stop_requested.wait(0.5):
            pass
        running.health.enter_graceful_shutdown()
        if on_stopping is not None:
            on_stopping(running)
        running.stop()
    log.info("%s stopped", config.service)
    return 0


def serve_service(
    args: argparse.Namespace,
    *,
    service: str,
    bindings: Callable[[], list[ServiceBinding]],
    start_serving: bool = True,
    on_started: Callable[[GrpcServer], None] | None = None,
    on_stopping: Callable[[GrpcServer], None] | None = None,
) -> int:
    """What every ``services/<name>/server.py:serve(args)`` does: resolve the config (flags,
    then SHARDLINE_* env, then defaults), set up logging, build the servicers, serve until a
    signal. A bad setting exits 2 with the message instead of a traceback."""
    try:
        config = ServerConfig.from_args(args, service=service)
        security = TransportSecurity.from_args(args)
    except InvalidArgument as exc:
        print(f"shardline serve {service}: {exc}", file=sys.stderr)
        return 2
    configure_logging(config.log_level)
    return run_until_signal(config, bindings(), start_serving=start_serving, on_started=on_started,
                            on_stopping=on_stopping, security=security)
