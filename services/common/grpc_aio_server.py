"""The asyncio twin of :mod:`services.common.grpc_server`, for a service whose RPCs are relays.

A service that mostly forwards streams (the router: one worker stream in, one client stream
out, per request) spends its CPU on moving messages, and the threaded server moves each message
through a pool thread, a condition variable and the GIL twice. Here every RPC is a coroutine on
one event loop, so relaying a message is an await, not a thread switch. Behaviour is the same
as the threaded helper's:

- ``grpc.health.v1.Health`` (the asyncio servicer) answers SERVING for "" and each service's full
  name, NOT_SERVING once shutdown starts;
- reflection lists the services;
- :class:`AioErrorInterceptor` turns a :class:`~services.common.errors.ShardlineError` raised by a
  handler into its status through the same :func:`~services.common.grpc_server.status_for`;
- :func:`serve_until_signal`: SIGTERM/SIGINT turns health NOT_SERVING, runs ``on_stopping``, then
  stops with grace; a second signal stops at once.

Handlers are ``async def`` functions (or async generators); a plain function would run on the
``migration_thread_pool`` sized by ``--max-workers``.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import signal
from collections.abc import Awaitable, Callable
from concurrent import futures
from dataclasses import dataclass, field
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2

from services.common import heap
from services.common.config import ServerConfig
from services.common.errors import InvalidArgument, ShardlineError
from services.common.grpc_server import (
    SERVER_OPTIONS,
    BindError,
    ServiceBinding,
    checked_request,
    host_port,
    register_services,
    rewrap_handler,
    status_for,
    warn_if_exposed,
)
from services.common.transport_security import TransportSecurity

log = logging.getLogger(__name__)


async def _abort(context: grpc.aio.ServicerContext, exc: ShardlineError) -> None:
    code = status_for(exc)
    log.info("%s: %s", code.name, exc)
    await context.abort(code, str(exc))


def _wrap_coroutine(behavior: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
    # a coroutine handler (unary, or streaming through ``context.write``): wrapping it costs
    # nothing per streamed message
    async def wrapped(request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            return await behavior(checked_request(request), context)
        except ShardlineError as exc:
            await _abort(context, exc)

    return wrapped


def _wrap_async_generator(behavior: Callable[..., Any]) -> Callable[..., Any]:
    async def wrapped(request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            async for response in behavior(checked_request(request), context):
                yield response
        except ShardlineError as exc:
            await _abort(context, exc)

    return wrapped


def _wrap(behavior: Callable[..., Any]) -> Callable[..., Any]:
    if inspect.isasyncgenfunction(behavior):
        return _wrap_async_generator(behavior)
    if inspect.iscoroutinefunction(behavior):
        return _wrap_coroutine(behavior)
    return behavior  # a sync handler on the migration pool: left to grpc


class AioErrorInterceptor(grpc.aio.ServerInterceptor):
    """ShardlineError -> ``context.abort(code, message)``; other exceptions are left to grpc,
    which logs them and answers UNKNOWN (they are bugs). Wrapped handlers are cached per method."""

    def __init__(self) -> None:
        self._wrapped: dict[str, grpc.RpcMethodHandler | None] = {}

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler | None]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        method = handler_call_details.method
        if method in self._wrapped:
            return self._wrapped[method]
        handler = await continuation(handler_call_details)
        wrapped = handler if handler is None else rewrap_handler(handler, _wrap, _wrap)
        self._wrapped[method] = wrapped
        return wrapped


@dataclass
class AioGrpcServer:
    """A started grpc.aio server with its health servicer. Build with :func:`start_aio_server`."""

    config: ServerConfig
    server: grpc.aio.Server
    health: Any  # grpc_health.v1.health.aio.HealthServicer
    port: int
    service_names: tuple[str, ...]
    _stopped: bool = field(default=False)

    @property
    def address(self) -> str:
        return host_port(self.config.host, self.port)

    async def set_serving(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", *self.service_names):
            await self.health.set(name, status)

    async def stop(self, grace_s: float | None = None) -> None:
        """NOT_SERVING first, then stop with grace; returns once every in-flight RPC has finished
        or the grace ran out (the rest are cancelled)."""
        if self._stopped:
            return
        self._stopped = True
        await self.health.enter_graceful_shutdown()
        await self.server.stop(self.config.grace_s if grace_s is None else grace_s)


async def start_aio_server(config: ServerConfig, bindings: list[ServiceBinding], *,
                           start_serving: bool = True, security: TransportSecurity | None = None) -> AioGrpcServer:
    """Bind ``config.address`` (TLS and the internal token as ``security`` says), register the
    services, health and reflection, and start, on the running event loop. Raises
    :class:`BindError` when the port cannot be bound."""
    security = security or TransportSecurity()
    if security.required_token(config.service):
        raise InvalidArgument(f"{config.service} would need the internal token, which only the threaded "
                              f"server checks")
    server = grpc.aio.server(
        migration_thread_pool=futures.ThreadPoolExecutor(max_workers=config.max_workers,
                                                         thread_name_prefix=f"{config.service}-rpc"),
        interceptors=[AioErrorInterceptor()],
        options=SERVER_OPTIONS,
    )
    health_servicer = health.aio.HealthServicer()
    names = register_services(server, bindings, health_servicer, with_reflection=config.reflection)
    warn_if_exposed(config, security)
    try:
        port = security.bind(server, config.address, service=config.service)
    except RuntimeError as exc:
        await server.stop(None)
        raise BindError(f"cannot bind {config.address} for {config.service}: {exc}") from exc
    if port == 0:
        await server.stop(None)
        raise BindError(f"cannot bind {config.address} for {config.service} (port in use?)")
    await server.start()
    running = AioGrpcServer(config=config, server=server, health=health_servicer, port=port, service_names=names)
    await running.set_serving(start_serving)
    return running


async def serve_until_signal(
    config: ServerConfig,
    bindings: list[ServiceBinding],
    *,
    on_stopping: Callable[[AioGrpcServer], Awaitable[None]] | None = None,
    security: TransportSecurity | None = None,
) -> int:
    """Serve on the running loop until SIGTERM or SIGINT, then shut down gracefully; returns the
    exit code (0, or 1 when the port cannot be bound). ``on_stopping`` runs after health turns
    NOT_SERVING and before the server stops (e.g. to stop the process's other parts)."""
    loop = asyncio.get_running_loop()
    stop_requested = asyncio.Event()
    running: AioGrpcServer | None = None

    def handle(signum: int) -> None:
        name = signal.Signals(signum).name
        if stop_requested.is_set():
            log.warning("second %s: stopping without grace", name)
            if running is not None:
                loop.create_task(running.server.stop(0))
            return
        log.info("%s: shutting down (grace %.1f s)", name, config.grace_s)
        stop_requested.set()

    signums = (signal.SIGTERM, signal.SIGINT)
    for signum in signums:
        loop.add_signal_handler(signum, handle, signum)
    try:
        try:
            running = await start_aio_server(config, bindings, security=security)
        except BindError as exc:
            log.error("%s", exc)
            return 1
        log.info("%s serving %s on %s", config.service, ", ".join(running.service_names), running.address)
        heap.started()
        await stop_requested.wait()
        await running.health.enter_graceful_shutdown()
        if on_stopping is not None:
            await on_stopping(running)
        await running.stop()
    finally:
        for signum in signums:
            loop.remove_signal_handler(signum)
    log.info("%s stopped", config.service)
    return 0
