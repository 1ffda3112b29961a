"""The OpenAI-compatible HTTP front door (FastAPI on uvicorn, on the router's event loop).

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (``stream: true`` sends
Server-Sent Events in OpenAI's chunk format, ending with ``data: [DONE]``), ``GET /v1/models``,
``POST /tokenize`` and ``POST /detokenize`` (vLLM's shapes, ``tokenize_api.py``), ``GET /version``,
``GET /health`` (200 while a replica group takes requests, else 503), ``GET /metrics``
(Prometheus, the process's default registry) and ``GET /openapi.json`` (``openapi.py``; no docs
UIs). Bodies are read and checked by ``edge.py`` first (400/413/415). Errors use OpenAI's body
``{"error": {"message", "type", "param", "code"}}`` with 400/401/404/429/503.

The handlers are module-level functions on one ``APIRouter`` (``routes``); what they share (the
router core, the API key check, the body limit) is a ``FrontDoor`` on ``app.state``. They read,
check and parse a request; ``http_serving.py`` serves it. uvicorn serves on the same event loop
as the gRPC server, so a request's generation is the same coroutine relay as a gRPC stream's
(``service.py``), iterated there.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import socket
from collections.abc import Iterator
from importlib.metadata import version as package_version
from typing import Any

import uvicorn
from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from services.common.errors import InvalidArgument, NotFound, PayloadTooLarge, ShardlineError
from services.common.transport_security import TransportSecurity
from services.router import edge, tokenize_api
from services.router import http_serving as serving
from services.router import openai_format as oa
from services.router.admission import RequestCancelled
from services.router.auth import ApiKeyCheck
from services.router.openapi import openapi_document
from services.router.service import RouterCore

log = logging.getLogger(__name__)
VERSION = package_version("shardline")
# Chat bodies up to this size are templated and tokenized on the loop (a millisecond or two).
INLINE_CHAT_BYTES = 16 * 1024
# How much of a too-large body is read (and dropped) before answering 413.
DRAIN_MAX_BYTES = 64 * 2**20


def error_response(exc: BaseException) -> JSONResponse:
    status, body = oa.error_body(exc)
    return JSONResponse(body, status_code=status)


@dataclasses.dataclass(frozen=True)
class FrontDoor:
    """What the route handlers share, on ``app.state.front``."""

    core: RouterCore
    auth: ApiKeyCheck
    max_body_bytes: int
    metrics_auth: bool
    document: dict[str, Any]

    def authorize(self, request: Request) -> None:
        self.auth.check(request.headers.get("authorization"))


routes = APIRouter()


def create_app(core: RouterCore, auth: ApiKeyCheck, *, max_body_bytes: int = edge.DEFAULT_MAX_BODY_BYTES,
               metrics_auth: bool = False) -> FastAPI:
    """The app; ``metrics_auth`` puts ``/metrics`` behind the API key too."""
    app = FastAPI(title="shardline router", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.front = FrontDoor(core, auth, max_body_bytes, metrics_auth, openapi_document())
    app.add_exception_handler(ShardlineError, _domain_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.include_router(routes)
    return app


def _front(request: Request) -> FrontDoor:
    return request.app.state.front


async def _domain_error(_request: Request, exc: Exception) -> JSONResponse:
    return error_response(exc)


async def _validation_error(_request: Request, exc: Exception) -> JSONResponse:
    return error_response(InvalidArgument(str(exc)))


async def _http_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    if exc.status_code == 404:
        return error_response(NotFound(f"no route {request.method} {request.url.path}"))
    status, body = 400, {"error": {"message": str(exc.detail), "type": "invalid_request_error",
                                   "param": None, "code": None}}
    return JSONResponse(body, status_code=exc.status_code or status)


async def json_body(request: Request) -> tuple[dict[str, Any], int]:
    """The body as a JSON object and its size in bytes (edge.py has the rules)."""
    front = _front(request)
    edge.check_content_type(request.headers.get("content-type"))
    edge.check_declared_length(request.headers.get("content-length"), front.max_body_bytes)
    reader = edge.BodyReader(front.max_body_bytes)
    stream = request.stream()
    try:
        try:
            async for chunk in stream:
                reader.feed(chunk)
        except PayloadTooLarge:
            # the rest of the body is read and dropped, up to a bound, so that a client still
            # sending reads the 413 rather than a reset connection
            size = reader.size
            async for chunk in stream:
                size += len(chunk)
                if size > DRAIN_MAX_BYTES:
                    break
            raise
    except ClientDisconnect:
        raise RequestCancelled("the client disconnected while sending the body") from None
    return (reader.parse() if reader.parse_inline else await front.core.off_loop(reader.parse)), reader.size


@routes.get("/openapi.json")
async def openapi(request: Request) -> JSONResponse:
    return JSONResponse(_front(request).document)


@routes.get("/health")
async def health(request: Request) -> JSONResponse:
    groups = _front(request).core.groups()
    healthy = sum(1 for g in groups if g.status.routable)
    body = {"status": "ok" if healthy else "unavailable", "replica_groups": len(groups),
            "healthy_replica_groups": healthy}
    return JSONResponse(body, status_code=200 if healthy else 503)


@routes.get("/metrics")
async def metrics(request: Request) -> Response:
    front = _front(request)
    if front.metrics_auth:
        front.authorize(request)
    # off the loop: collecting may fetch federated upstreams' /metrics over HTTP
    return Response(await asyncio.to_thread(generate_latest, REGISTRY), media_type=CONTENT_TYPE_LATEST)


@routes.get("/v1/models")
async def models(request: Request) -> JSONResponse:
    front = _front(request)
    front.authorize(request)
    data = [{"id": m.name, "object": "model", "created": 0, "owned_by": "shardline",
             "max_model_len": m.max_model_len} for m in front.core.catalog]
    return JSONResponse({"object": "list", "data": data})


@routes.get("/version")
async def version() -> JSONResponse:
    return JSONResponse({"version": VERSION})


async def authorized_body(request: Request) -> tuple[RouterCore, dict[str, Any], int]:
    """The caller's key checked and the body read: the router core, the body and its size."""
    front = _front(request)
    front.authorize(request)
    body, size = await json_body(request)
    return front.core, body, size


@routes.post("/tokenize")
async def tokenize(request: Request) -> JSONResponse:
    core, body, size = await authorized_body(request)
    model = core.catalog.get(_model_name(body))
    if size <= INLINE_CHAT_BYTES:
        return JSONResponse(tokenize_api.tokenize(body, model))
    return JSONResponse(await core.off_loop(tokenize_api.tokenize, body, model))


@routes.post("/detokenize")
async def detokenize(request: Request) -> JSONResponse:
    core, body, _size = await authorized_body(request)
    return JSONResponse(tokenize_api.detokenize(body, core.catalog.get(_model_name(body))))


@routes.post("/v1/completions")
async def completions(request: Request) -> Response:
    core, body, _size = await authorized_body(request)
    model = core.catalog.get(_model_name(body))
    batch = oa.parse_completions(body, model)
    first = batch[0]
    if first.best_of > 1 and first.stream:  # several choices of one prompt, streamed
        return await serving.serve_choices(core, request, first, "cmpl", chat=False)
    if first.best_of > 1:  # each prompt's choices, in order
        return await serving.serve_several(core, request, [c for p in batch for c in oa.choice_requests(p)],
                                           per_prompt=first.best_of, keep=first.n)
    if len(batch) > 1:
        return await serving.serve_several(core, request, batch)
    parsed = batch[0]
    if parsed.echo:
        return await serving.serve_echo(core, request, parsed)
    return await serving.serve(core, request, parsed, "cmpl", chat=False)


@routes.post("/v1/chat/completions")
async def chat_completions(request: Request) -> Response:
    core, body, size = await authorized_body(request)
    model = core.catalog.get(_model_name(body))
    limit = max((g.token_limit for g in core.groups(model.name)), default=0)
    if size <= INLINE_CHAT_BYTES:
        parsed = oa.parse_chat(body, model, token_limit=limit)
    else:  # many or long messages: templating and tokenizing them would hold the loop
        parsed = await core.off_loop(oa.parse_chat, body, model, token_limit=limit, release_gil=True)
    if parsed.n > 1 and parsed.stream:
        return await serving.serve_choices(core, request, parsed, "chatcmpl", chat=True)
    if parsed.n > 1:
        return await serving.serve_several(core, request, oa.choice_requests(parsed), per_prompt=parsed.n,
                                           keep=parsed.n, chat=True)
    return await serving.serve(core, request, parsed, "chatcmpl", chat=True)


def _model_name(body: dict[str, Any]) -> str:
    model = body.get("model", "")
    if model is not None and not isinstance(model, str):
        raise oa.BadRequest(f"model must be a string, got {model!r}", "model")
    return model or ""


class _EmbeddedServer(uvicorn.Server):
    """uvicorn inside the router's event loop: the router, not uvicorn, handles the signals."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class HttpServer:
    """uvicorn on the running event loop, on a socket bound here (so a taken port is an OSError
    at start, not an exit inside uvicorn); ``await stop()`` asks it to exit and waits."""

    def __init__(self, app: FastAPI, host: str, port: int, *, security: TransportSecurity | None = None) -> None:
        tls = security if security is not None and security.serves_tls else None
        config = uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=False,
                                lifespan="off", timeout_graceful_shutdown=2,
                                ssl_certfile=tls.cert_file if tls else None, ssl_keyfile=tls.key_file if tls else None)
        self.server = _EmbeddedServer(config)
        self.host = host
        self._socket: socket.socket | None = None
        self._task: asyncio.Task[None] | None = None

    @property
    def port(self) -> int:
        """The bound port (the requested one, or the one picked for port 0)."""
        if self._socket is not None:
            return self._socket.getsockname()[1]
        return self.server.config.port

    async def start(self, timeout_s: float = 10.0) -> HttpServer:
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        self._socket = socket.create_server((self.host, self.server.config.port), family=family,
                                            backlog=self.server.config.backlog)
        self._task = asyncio.get_running_loop().create_task(self.server.serve(sockets=[self._socket]))
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while not self.server.started:
            if self._task.done():
                self._task.result()  # its error, if it has one
                raise OSError(f"the HTTP server could not start on {self.host}:{self.port}")
            if loop.time() > deadline:
                raise OSError(f"the HTTP server did not start on {self.host}:{self.port} within {timeout_s:g} s")
            await asyncio.sleep(0.01)
        return self

    async def stop(self, timeout_s: float = 5.0) -> None:
        self.server.should_exit = True
        if self._task is not None:
            with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError):
                await asyncio.wait_for(self._task, timeout_s)
        if self._socket is not None:
            self._socket.close()
