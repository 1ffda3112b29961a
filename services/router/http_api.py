"""The OpenAI-compatible HTTP front door (FastAPI on uvicorn, on the router's event loop).

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (``stream: true`` sends
Server-Sent Events in OpenAI's chunk format, ending with ``data: [DONE]``), ``GET /v1/models``,
``POST /tokenize`` and ``POST /detokenize`` (vLLM's shapes, ``tokenize_api.py``), ``GET /version``,
``GET /health`` (200 while a replica group takes requests, else 503), ``GET /metrics``
(Prometheus, the process's default registry) and ``GET /openapi.json`` (``openapi.py``; no docs
UIs). Bodies are read and checked by ``edge.py`` first (400/413/415). Errors use OpenAI's body
``{"error": {"message", "type", "param", "code"}}`` with 400/401/404/429/503.

uvicorn serves on the same event loop as the gRPC server, so a request's generation is the
same coroutine relay as a gRPC stream's (``service.py``), iterated right here. A client that
disconnects ends the response; the generation is then cancelled, which cancels the worker call
and releases the reservation.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import socket
from collections.abc import AsyncIterator, Iterator
from importlib.metadata import version as package_version
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.types import Receive, Scope, Send

from services.common.errors import InvalidArgument, NotFound, PayloadTooLarge, ShardlineError
from services.common.sampling import FinishReason
from services.common.transport_security import TransportSecurity
from services.router import edge, tokenize_api
from services.router import openai_format as oa
from services.router.admission import RequestCancelled
from services.router.auth import ApiKeyCheck
from services.router.openapi import openapi_document
from services.router.service import Generation, RouterCore
from services.router.sse import choices_stream
from services.router.types import Finished, TokenOut, trace_context_of

log = logging.getLogger(__name__)
VERSION = package_version("shardline")
# Chat bodies up to this size are templated and tokenized on the loop (a millisecond or two).
INLINE_CHAT_BYTES = 16 * 1024
# How much of a too-large body is read (and dropped) before answering 413.
DRAIN_MAX_BYTES = 64 * 2**20


class CancellingStreamingResponse(StreamingResponse):
    """A streaming response that cancels and closes its generations (one per choice) however it
    ends (done, error, disconnect): the worker calls stop and the reservations are released."""

    def __init__(self, content: AsyncIterator[str], generations: list[Generation], **kwargs: Any) -> None:
        super().__init__(content, **kwargs)
        self._generations = generations

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            for generation in self._generations:
                generation.cancel()
                generation.close()


def error_response(exc: BaseException) -> JSONResponse:
    status, body = oa.error_body(exc)
    return JSONResponse(body, status_code=status)


def create_app(core: RouterCore, auth: ApiKeyCheck, *, max_body_bytes: int = edge.DEFAULT_MAX_BODY_BYTES,
               metrics_auth: bool = False) -> FastAPI:
    """The app; ``metrics_auth`` puts ``/metrics`` behind the API key too."""
    app = FastAPI(title="shardline router", docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(ShardlineError)
    async def _domain_error(_request: Request, exc: ShardlineError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_request: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(InvalidArgument(str(exc)))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 404:
            return error_response(NotFound(f"no route {_request.method} {_request.url.path}"))
        status, body = 400, {"error": {"message": str(exc.detail), "type": "invalid_request_error",
                                       "param": None, "code": None}}
        return JSONResponse(body, status_code=exc.status_code or status)

    def authorize(request: Request) -> None:
        auth.check(request.headers.get("authorization"))

    async def json_body(request: Request) -> tuple[dict[str, Any], int]:
        """The body as a JSON object and its size in bytes (edge.py has the rules)."""
        edge.check_content_type(request.headers.get("content-type"))
        edge.check_declared_length(request.headers.get("content-length"), max_body_bytes)
        reader = edge.BodyReader(max_body_bytes)
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
        return (reader.parse() if reader.parse_inline else await core.off_loop(reader.parse)), reader.size

    document = openapi_document()

    @app.get("/openapi.json")
    async def openapi() -> JSONResponse:
        return JSONResponse(document)

    @app.get("/health")
    async def health() -> JSONResponse:
        groups = core.groups()
        healthy = sum(1 for g in groups if g.status.routable)
        body = {"status": "ok" if healthy else "unavailable", "replica_groups": len(groups),
                "healthy_replica_groups": healthy}
        return JSONResponse(body, status_code=200 if healthy else 503)

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        if metrics_auth:
            authorize(request)
        # off the loop: collecting may fetch federated upstreams' /metrics over HTTP
        return Response(await asyncio.to_thread(generate_latest, REGISTRY), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models(request: Request) -> JSONResponse:
        authorize(request)
        data = [{"id": m.name, "object": "model", "created": 0, "owned_by": "shardline",
                 "max_model_len": m.max_model_len} for m in core.catalog]
        return JSONResponse({"object": "list", "data": data})

    @app.get("/version")
    async def version() -> JSONResponse:
        return JSONResponse({"version": VERSION})

    @app.post("/tokenize")
    async def tokenize(request: Request) -> JSONResponse:
        authorize(request)
        body, size = await json_body(request)
        model = core.catalog.get(_model_name(body))
        if size <= INLINE_CHAT_BYTES:
            return JSONResponse(tokenize_api.tokenize(body, model))
        return JSONResponse(await core.off_loop(tokenize_api.tokenize, body, model))

    @app.post("/detokenize")
    async def detokenize(request: Request) -> JSONResponse:
        authorize(request)
        body, _size = await json_body(request)
        return JSONResponse(tokenize_api.detokenize(body, core.catalog.get(_model_name(body))))

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        authorize(request)
        body, _size = await json_body(request)
        model = core.catalog.get(_model_name(body))
        batch = oa.parse_completions(body, model)
        first = batch[0]
        if first.best_of > 1 and first.stream:  # several choices of one prompt, streamed
            return await _serve_choices(request, first, "cmpl", chat=False)
        if first.best_of > 1:  # each prompt's choices, in order
            return await _serve_several(request, [c for p in batch for c in oa.choice_requests(p)],
                                        per_prompt=first.best_of, keep=first.n)
        if len(batch) > 1:
            return await _serve_several(request, batch)
        parsed = batch[0]
        if parsed.echo:
            return await _serve_echo(request, parsed)
        return await _serve(request, parsed, "cmpl", chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        authorize(request)
        body, size = await json_body(request)
        model = core.catalog.get(_model_name(body))
        limit = max((g.token_limit for g in core.groups(model.name)), default=0)
        if size <= INLINE_CHAT_BYTES:
            parsed = oa.parse_chat(body, model, token_limit=limit)
        else:  # many or long messages: templating and tokenizing them would hold the loop
            parsed = await core.off_loop(oa.parse_chat, body, model, token_limit=limit, release_gil=True)
        if parsed.n > 1 and parsed.stream:
            return await _serve_choices(request, parsed, "chatcmpl", chat=True)
        if parsed.n > 1:
            return await _serve_several(request, oa.choice_requests(parsed), per_prompt=parsed.n, keep=parsed.n,
                                        chat=True)
        return await _serve(request, parsed, "chatcmpl", chat=True)

    async def _serve_echo(request: Request, parsed: oa.ParsedRequest) -> Response:
        """``echo``: the prompt scored on a group (its logprobs and alternatives), then, unless
        ``max_tokens`` is 0, a generation from the same ids, as one non-streamed answer."""
        answer, groups = await _echo_answer(request, parsed, trace_context_of(request.headers.items()))
        headers = {"x-shardline-replica-group-id": answer["replica_group_id"],
                   "x-shardline-replica-group-ids": ",".join(groups)}
        return JSONResponse(answer, headers=headers)

    async def _echo_answer(request: Request | None, parsed: oa.ParsedRequest,
                           trace: dict[str, str]) -> tuple[dict[str, Any], list[str]]:
        """The echo answer's body and the groups that served it; ``request`` None: the caller
        watches for the client's disconnect (several prompts)."""
        top = parsed.request.sampling.logprobs
        scored = await core.score(dataclasses.replace(parsed.request, trace_context=trace), top)
        model = core.catalog.get(parsed.request.model)
        prompt_text = parsed.request.prompt_text if parsed.request.prompt_text is not None else \
            model.decode(scored.token_ids)
        tokens: list[TokenOut] = []
        groups = [scored.replica_group_id] if scored.replica_group_id else []
        finished = Finished(FinishReason.LENGTH, len(scored.token_ids), 0)
        if parsed.generate:
            generation = await core.generate(dataclasses.replace(
                parsed.request, prompt_text=None, prompt_ids=tuple(scored.token_ids), request_id=scored.request_id),
                token_texts=parsed.want_logprobs)
            try:
                if request is None:
                    await generation.start()
                else:
                    await _unless_disconnected(request, generation.start(), generation)
                async for event in generation:
                    if isinstance(event, Finished):
                        finished = event
                    else:
                        tokens.append(event)
            except BaseException:
                generation.cancel()
                raise
            finally:
                generation.close()
            groups += generation.replica_group_ids
        head = oa.ResponseHeader(f"cmpl-{scored.request_id}", model.name, groups[-1] if groups else "")
        return oa.echo_completion_response(head, scored, prompt_text, tokens, finished, parsed.want_logprobs), groups

    async def _plain_answer(parsed: oa.ParsedRequest, trace: dict[str, str], *,
                            chat: bool = False) -> tuple[dict[str, Any], list[str], float]:
        """One non-streamed choice of several: its body, groups and the sum of its tokens' logprobs."""
        generation = await core.generate(dataclasses.replace(parsed.request, trace_context=trace),
                                         token_texts=parsed.want_logprobs)
        tokens: list[TokenOut] = []
        try:
            await generation.start()
            async for event in generation:
                if isinstance(event, Finished):
                    finished = event
                    break
                tokens.append(event)
            else:
                raise AssertionError("a stream always ends with Finished or an error")
        except BaseException:
            generation.cancel()
            raise
        finally:
            generation.close()
        groups = generation.replica_group_ids or [generation.replica_group_id]
        head = oa.ResponseHeader(f"{'chatcmpl' if chat else 'cmpl'}-{generation.request_id}",
                                 generation.prepared.model.name, groups[-1])
        return oa.answer(head, tokens, finished, parsed, chat=chat), groups, sum(t.logprob for t in tokens)

    async def _with_score(answer: Any) -> tuple[dict[str, Any], list[str], float]:
        body, groups = await answer
        return body, groups, 0.0

    async def _serve_several(request: Request, batch: list[oa.ParsedRequest], *, per_prompt: int = 1,
                             keep: int = 1, chat: bool = False) -> Response:
        """Several choices in one request (several prompts, ``per_prompt`` candidates each): each
        admitted and served as its own request, all at once; of each prompt's candidates the
        ``keep`` with the highest logprob sum are answered (``best_of``). One that fails fails the
        request (the others are cancelled), and so does the client leaving."""
        trace = trace_context_of(request.headers.items())
        tasks = [asyncio.ensure_future(_with_score(_echo_answer(None, p, trace)) if p.echo else
                                       _plain_answer(p, trace, chat=chat)) for p in batch]

        async def all_answers() -> list[tuple[dict[str, Any], list[str], float]]:
            return list(await asyncio.gather(*tasks))

        work = asyncio.ensure_future(all_answers())
        watcher = asyncio.ensure_future(_disconnected(request))
        try:
            await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watcher.cancel()
            if not work.done():
                work.cancel()
            for task in tasks:
                task.cancel()  # no-op for those done
            await asyncio.gather(*tasks, return_exceptions=True)
        if not work.done() or work.cancelled():
            raise RequestCancelled("a request of several prompts: the client disconnected")
        answers = work.result()  # the first prompt's error, if one failed
        groups = [g for _answer, answer_groups, _score in answers for g in answer_groups]
        if keep < per_prompt:  # best_of: each prompt's best candidates, best first
            answers = [a for start in range(0, len(answers), per_prompt)
                       for a in sorted(answers[start:start + per_prompt], key=lambda a: -a[2])[:keep]]
        body = oa.several_completions_response([answer for answer, _groups, _score in answers], per_prompt=keep)
        return JSONResponse(body, headers={"x-shardline-replica-group-id": body["replica_group_id"],
                                           "x-shardline-replica-group-ids": ",".join(dict.fromkeys(groups))})

    async def _serve_choices(request: Request, parsed: oa.ParsedRequest, prefix: str, *, chat: bool) -> Response:
        """``n`` choices of one prompt, streamed together (``sse.choices_stream``): every one admitted
        before the first byte, so a refusal is still a plain HTTP error."""
        trace = trace_context_of(request.headers.items())
        generations: list[Generation] = []
        try:
            for choice in oa.choice_requests(parsed):
                generation = await core.generate(dataclasses.replace(choice.request, trace_context=trace),
                                                 token_texts=parsed.want_logprobs)
                generations.append(generation)
                await _unless_disconnected(request, generation.start(), generation)
        except BaseException:
            for generation in generations:
                generation.cancel()
                generation.close()
            raise
        name = generations[0].prepared.model.name
        heads = [oa.ResponseHeader(f"{prefix}-{generations[0].request_id}", name, g.replica_group_id)
                 for g in generations]
        headers = {"x-shardline-replica-group-id": generations[0].replica_group_id, "cache-control": "no-cache"}
        return CancellingStreamingResponse(choices_stream(generations, heads, parsed, chat=chat), generations,
                                           media_type="text/event-stream", headers=headers)

    async def _serve(request: Request, parsed: oa.ParsedRequest, prefix: str, *, chat: bool) -> Response:
        generation_request = dataclasses.replace(parsed.request,
                                                 trace_context=trace_context_of(request.headers.items()))
        generation = await core.generate(generation_request, token_texts=parsed.want_logprobs)
        # admission errors become plain HTTP errors; a client gone while queued is let go
        await _unless_disconnected(request, generation.start(), generation)
        head = oa.ResponseHeader(f"{prefix}-{generation.request_id}", generation.prepared.model.name,
                                 generation.replica_group_id)
        # a header goes out before the first byte: on a stream it names the group the stream
        # started on, and each chunk names the group that produced it (the last ones the final group)
        headers = {"x-shardline-replica-group-id": generation.replica_group_id}
        if parsed.stream:
            return CancellingStreamingResponse(choices_stream([generation], [head], parsed, chat=chat), [generation],
                                               media_type="text/event-stream",
                                               headers={**headers, "cache-control": "no-cache"})
        tokens: list[TokenOut] = []

        async def collect() -> Finished:
            async for event in generation:
                if isinstance(event, Finished):
                    return event
                tokens.append(event)
            raise AssertionError("a stream always ends with Finished or an error")

        try:
            finished = await _unless_disconnected(request, collect(), generation)
        finally:
            generation.close()
        # the whole answer is known: name the group of its last token, and every group that produced some
        head.replica_group_id = generation.replica_group_id
        headers = {"x-shardline-replica-group-id": generation.replica_group_id,
                   "x-shardline-replica-group-ids": ",".join(generation.replica_group_ids or [head.replica_group_id])}
        return JSONResponse(oa.answer(head, tokens, finished, parsed, chat=chat), headers=headers)

    return app


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _unless_disconnected(request: Request, work: Any, generation: Generation) -> Any:
    """Await ``work``; if the client disconnects first, cancel the generation (the worker call
    and the reservation go with it) and raise RequestCancelled."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        generation.cancel()
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if not task.done():
        generation.cancel()
        task.cancel()
        raise RequestCancelled(f"request {generation.request_id}: the client disconnected")
    exc = task.exception()
    if exc is not None:
        generation.cancel()
        raise exc
    return task.result()


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
