"""gRPC client of one replica group's WorkerService, in the router's domain terms.

The only router module besides ``server.py`` that speaks gRPC: Stats answers become
:class:`~services.router.replicas.WorkerStats`, and every request routed to the worker rides
the one :class:`WorkerRelay` stream the client keeps open to it (``WorkerService.Relay``: the
worker sends one message per engine step with that step's tokens of all of them, so relaying a
token costs the router no gRPC read of its own). Each request is an :class:`UpstreamStream`
whose ``await next()`` gives :class:`UpstreamToken` events then one :class:`UpstreamFinished`;
a failure becomes a ShardlineError (a group that failed mid-generation, UNAVAILABLE with the ids
it had produced, becomes :class:`WorkerFailed`, which carries those ids; a draining worker
:class:`WorkerRejected`, one whose KV budget is full :class:`WorkerFull`; a broken relay stream
WorkerFailed for each of its live requests).

Two channels per worker: a blocking one for the poller thread's Stats and health checks, and a
grpc.aio one, made on the router's event loop, for the Relay stream that the loop reads.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.errors import (
    KV_BUDGET_FULL,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    ShardlineError,
    Unavailable,
)
from services.common.proto import common_pb2, worker_pb2, worker_pb2_grpc
from services.common.proto_convert import DTYPE_FROM_PB, finish_reason_from_pb, sampling_to_pb
from services.common.sampling import FinishReason, SamplingParams
from services.common.transport_security import TransportSecurity, open_aio_channel, open_channel
from services.router.admission import RequestCancelled
from services.router.replicas import StatsLate, WorkerStats

# Reconnects back off to at most 2 s (gRPC's default grows to 120 s): a worker restarted at the
# same address (a new replica group there) is polled, and so routable, within a poll or two.
CHANNEL_OPTIONS = [("grpc.keepalive_time_ms", 10_000), ("grpc.keepalive_timeout_ms", 5_000),
                   ("grpc.http2.max_pings_without_data", 0), ("grpc.initial_reconnect_backoff_ms", 250),
                   ("grpc.min_reconnect_backoff_ms", 250), ("grpc.max_reconnect_backoff_ms", 2_000)]


class WorkerFailed(Unavailable):
    """The group failed mid-stream; ``token_ids`` are the ones it had produced."""

    def __init__(self, message: str, token_ids: list[int]) -> None:
        super().__init__(message)
        self.token_ids = token_ids


class WorkerRejected(Unavailable):
    """The worker refused the request before producing anything (draining, stopping)."""


class WorkerFull(WorkerRejected):
    """The worker refused the request because its KV claim does not fit beside the requests the
    group admitted already (from this router or another): try another group, or wait."""


@dataclass(slots=True)  # one per relayed token: not frozen, which would cost a setattr call per field
class UpstreamToken:
    token_id: int
    logprob: float
    top_logprobs: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True, slots=True)
class UpstreamFinished:
    """A worker's end of a generation (a stop string is matched in the router, never here)."""

    reason: FinishReason
    prompt_tokens: int
    completion_tokens: int


@dataclass(frozen=True)
class UpstreamScore:
    """A worker's Score answer: ``logprobs[i]`` of token ``i+1``, its alternatives, nll."""

    logprobs: list[float]
    top_logprobs: list[list[tuple[int, float]]]
    nll: float
    perplexity: float


STATUS_BY_NUMBER = {code.value[0]: code for code in grpc.StatusCode}


def error_for_status(code: grpc.StatusCode, details: str, address: str, *,
                     generated: list[int] | None = None) -> ShardlineError:
    """A worker's failure status as the domain error the router's client should see;
    ``generated``: the ids a group that failed mid-generation had produced (None: not sent)."""
    if code == grpc.StatusCode.CANCELLED:
        return RequestCancelled(f"the call to worker {address} was cancelled")
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        return InvalidArgument(details)
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        if generated is None and details.startswith(KV_BUDGET_FULL):
            return WorkerFull(f"worker {address}: {details}")
        return ResourceExhausted(details)
    if code == grpc.StatusCode.NOT_FOUND:
        return NotFound(details)
    if code == grpc.StatusCode.UNAVAILABLE:
        if generated is not None:
            return WorkerFailed(f"replica group at {address} failed: {details}", generated)
        if "draining" in details:
            return WorkerRejected(f"worker {address}: {details}")
    return WorkerFailed(f"worker {address}: {code.name}: {details}", [])


class UpstreamStream:
    """One request on a worker's Relay stream, on the router's event loop: ``await next()`` for
    each event (after UpstreamFinished, do not call it again); ``cancel()`` stops the worker's
    sequence. The relay's reader hands it its events (:meth:`_deliver`)."""

    __slots__ = ("relay", "relay_id", "address", "_events", "_waiter", "_failure", "_ended")

    def __init__(self, relay: WorkerRelay, relay_id: int) -> None:
        self.relay = relay
        self.relay_id = relay_id
        self.address = relay.address
        self._events: collections.deque[UpstreamToken | UpstreamFinished | ShardlineError] = collections.deque()
        self._waiter: asyncio.Future | None = None
        self._failure: ShardlineError | None = None  # after the queued events: the relay broke, or cancelled
        self._ended = False  # the worker has nothing more for it (final event, relay broken, cancelled)

    async def next(self) -> UpstreamToken | UpstreamFinished:
        """The next event; raises the request's failure as a ShardlineError (``error_for_status``:
        WorkerFailed with the produced ids when the group failed), RequestCancelled after
        ``cancel()``, and WorkerFailed if the relay stream broke."""
        events = self._events
        while not events:
            if self._failure is not None:
                raise self._failure
            waiter = self._waiter = self.relay.loop.create_future()
            try:
                await waiter
            finally:
                self._waiter = None
        event = events.popleft()
        if event.__class__ is UpstreamToken or event.__class__ is UpstreamFinished:
            return event
        raise event

    def cancel(self, *, stop: bool = False) -> None:
        """``stop``: the router matched one of the request's stop strings (the worker records the
        request as finished by one), rather than the client going away."""
        self._failure = RequestCancelled(f"the request on worker {self.address} was cancelled")
        self._events.clear()
        self._wake()
        if not self._ended:
            self._ended = True
            self.relay.cancel(self.relay_id, stop=stop)

    def _deliver(self, event: UpstreamToken | UpstreamFinished | ShardlineError) -> None:
        self._events.append(event)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _fail(self, failure: ShardlineError) -> None:
        self._ended = True
        if self._failure is None:
            self._failure = failure
        self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)


class WorkerRelay:
    """The one Relay stream to a worker that every request routed there shares (the worker
    answers one message per engine step with the step's events of all of them): submits and
    cancels go out through an outbox, a reader task hands each event to its request's
    :class:`UpstreamStream`. When the stream breaks, every live request fails with WorkerFailed
    (and the client opens a new stream for the next one)."""

    def __init__(self, stub: worker_pb2_grpc.WorkerServiceStub, address: str) -> None:
        self.address = address
        self.loop = asyncio.get_running_loop()
        self.closed = False
        self._streams: dict[int, UpstreamStream] = {}
        self._ids = itertools.count(1)
        self._outbox: asyncio.Queue[worker_pb2.RelayRequest | None] = asyncio.Queue()
        self._call = stub.Relay(self._requests())
        self._reader = self.loop.create_task(self._read(), name=f"relay-{address}")

    @property
    def live(self) -> int:
        return len(self._streams)

    def submit(self, request_id: str, prompt_ids: list[int], sampling: SamplingParams, *,
               trace_context: Sequence[tuple[str, str]] = ()) -> UpstreamStream:
        relay_id = next(self._ids)
        stream = self._streams[relay_id] = UpstreamStream(self, relay_id)
        # reserve_kv: the worker admits it only if its KV claim fits (exact across routers)
        request = worker_pb2.GenerateRequest(request_id=request_id, token_ids=common_pb2.TokenIds(ids=prompt_ids),
                                             sampling=sampling_to_pb(sampling), reserve_kv=True)
        self._outbox.put_nowait(worker_pb2.RelayRequest(submit=worker_pb2.RelaySubmit(
            relay_id=relay_id, request=request, trace_context=dict(trace_context))))
        return stream

    def cancel(self, relay_id: int, *, stop: bool = False) -> None:
        if self._streams.pop(relay_id, None) is not None and not self.closed:
            reason = common_pb2.FINISH_REASON_STOP_SEQUENCE if stop else common_pb2.FINISH_REASON_CANCELLED
            self._outbox.put_nowait(worker_pb2.RelayRequest(cancel=worker_pb2.RelayCancel(relay_id=relay_id,
                                                                                          reason=reason)))

    async def aclose(self) -> None:
        """Half-close, cancel the call and wait for the reader (live requests fail)."""
        self._outbox.put_nowait(None)
        self._call.cancel()
        await asyncio.gather(self._reader, return_exceptions=True)

    async def _requests(self) -> AsyncIterator[worker_pb2.RelayRequest]:
        outbox = self._outbox
        while (message := await outbox.get()) is not None:
            yield message

    async def _read(self) -> None:
        streams = self._streams
        read = self._call.read
        address = self.address
        failure: ShardlineError = WorkerFailed(f"the relay stream to worker {address} was closed", [])
        try:
            while (response := await read()) is not grpc.aio.EOF:
                for event in response.events:
                    stream = streams.get(event.relay_id)
                    if stream is None:
                        continue  # cancelled: the worker stops sending once it sees the cancel
                    if event.HasField("token"):
                        token = event.token
                        top = token.top_logprobs
                        stream._deliver(UpstreamToken(token.token_id, token.logprob,
                                                      tuple([(t.token_id, t.logprob) for t in top]) if top else ()))
                        continue
                    del streams[event.relay_id]
                    stream._ended = True
                    if event.HasField("finished"):
                        stream._deliver(finished_from_pb(event.finished))
                    else:
                        error = event.error
                        stream._deliver(error_for_status(
                            STATUS_BY_NUMBER.get(error.code, grpc.StatusCode.UNKNOWN), error.message, address,
                            generated=list(error.generated.ids) if error.HasField("generated") else None))
            failure = WorkerFailed(f"worker {address} ended the relay stream", [])
        except grpc.RpcError as exc:
            # the stream broke (worker gone, connection lost): a failure of the worker's, even a
            # CANCELLED that none of its requests asked for
            failure = WorkerFailed(f"worker {address}: relay stream {exc.code().name}: {exc.details()}", [])
        except asyncio.CancelledError:
            pass  # aclose() cancelled the call
        finally:
            self.closed = True
            live = list(streams.values())
            streams.clear()
            self._outbox.put_nowait(None)
            for stream in live:
                stream._fail(failure)


def finished_from_pb(finished: common_pb2.GenerationFinished) -> UpstreamFinished:
    return UpstreamFinished(finish_reason_from_pb(finished.finish_reason), finished.usage.prompt_tokens,
                            finished.usage.completion_tokens)


class WorkerClient:
    """The channels to one worker, shared by its poller and every stream routed there."""

    def __init__(self, address: str, security: TransportSecurity | None = None) -> None:
        self.address = address
        self.security = security or TransportSecurity()
        self.channel = open_channel(address, self.security, options=CHANNEL_OPTIONS)
        self._stub = worker_pb2_grpc.WorkerServiceStub(self.channel)
        self._health = health_pb2_grpc.HealthStub(self.channel)
        self._aio_channel: grpc.aio.Channel | None = None
        self._aio_stub: worker_pb2_grpc.WorkerServiceStub | None = None
        self._relay: WorkerRelay | None = None

    def stats(self, timeout_s: float, prefix_cursor: tuple[str, int] | None = None) -> WorkerStats:
        request = worker_pb2.StatsRequest()
        if prefix_cursor is not None:
            request.prefix_cache_events = True
            request.prefix_cache_epoch, request.prefix_cache_after = prefix_cursor
        try:
            r = self._stub.Stats(request, timeout=timeout_s)
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                raise StatsLate(f"Stats of {self.address}: no answer within {timeout_s:g} s") from None
            raise Unavailable(f"Stats of {self.address}: {exc.code().name}: {exc.details()}") from None
        return WorkerStats(
            replica_group_id=r.replica_group_id, model_name=r.model_name, tp_degree=r.layout.tp_degree,
            pp_degree=r.layout.pp_degree, dtype=DTYPE_FROM_PB.get(r.layout.dtype, ""),
            kv_bytes_used=r.kv_bytes_used, kv_bytes_capacity=r.kv_bytes_capacity,
            kv_bytes_per_token=r.kv_bytes_per_token, max_model_len=r.max_model_len, running=r.running,
            waiting=r.waiting, blocks_used=r.blocks_used, blocks_total=r.blocks_total, draining=r.draining,
            prefix_cache_queries=r.prefix_cache_queries, prefix_cache_hits=r.prefix_cache_hits,
            blocks_cached=r.blocks_cached, prefix_cache_evictions=r.prefix_cache_evictions, block_size=r.block_size,
            prefix_epoch=r.prefix_cache_epoch, prefix_seq=r.prefix_cache_seq, prefix_snapshot=r.prefix_cache_snapshot,
            prefix_events=[(e.block_hash, e.removed) for e in r.prefix_cache_events],
            kv_bytes_admitted=r.kv_bytes_admitted, num_preemptions=r.num_preemptions)

    def serving(self, timeout_s: float) -> bool:
        try:
            response = self._health.Check(health_pb2.HealthCheckRequest(service=""), timeout=timeout_s)
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:  # slow, as a Stats can be: not a verdict
                raise StatsLate(f"health check of {self.address}: no answer within {timeout_s:g} s") from None
            return False
        return response.status == health_pb2.HealthCheckResponse.SERVING

    async def score(self, request_id: str, token_ids: list[int], top_logprobs: int) -> UpstreamScore:
        """The worker's Score (a no-cache prefill between its engine steps), on the event loop.
        A failure raises the domain error of its status (UNAVAILABLE: WorkerFailed)."""
        try:
            r = await self._aio().Score(_score_request(request_id, token_ids, top_logprobs))
        except grpc.aio.AioRpcError as exc:
            raise error_for_status(exc.code(), exc.details() or "", self.address, generated=[]) from None
        return _upstream_score(r)

    def score_blocking(self, request_id: str, token_ids: list[int], top_logprobs: int,
                       timeout_s: float) -> UpstreamScore:
        """The same Score on the blocking channel, for a thread of its own (the shadow mirror's),
        so that decoding the answer never runs on the event loop."""
        try:
            r = self._stub.Score(_score_request(request_id, token_ids, top_logprobs), timeout=timeout_s)
        except grpc.RpcError as exc:
            raise error_for_status(exc.code(), exc.details() or "", self.address, generated=[]) from None
        return _upstream_score(r)

    def _aio(self) -> worker_pb2_grpc.WorkerServiceStub:
        if self._aio_stub is None:
            self._aio_channel = open_aio_channel(self.address, self.security, options=CHANNEL_OPTIONS)
            self._aio_stub = worker_pb2_grpc.WorkerServiceStub(self._aio_channel)
        return self._aio_stub

    def generate(self, request_id: str, prompt_ids: list[int], sampling: SamplingParams, *,
                 trace_context: Sequence[tuple[str, str]] = ()) -> UpstreamStream:
        """Start a request on the worker's Relay stream (on the router's event loop, which the
        stream then belongs to; opened on first use and again after it broke);
        ``trace_context`` goes with the request (the caller's W3C trace context)."""
        relay = self._relay
        if relay is None or relay.closed:
            relay = self._relay = WorkerRelay(self._aio(), self.address)
        return relay.submit(request_id, prompt_ids, sampling, trace_context=trace_context)

    async def aclose(self) -> None:
        """Close the relay stream and the event loop's channel (on that loop)."""
        if self._relay is not None:
            await self._relay.aclose()
            self._relay = None
        if self._aio_channel is not None:
            await self._aio_channel.close()
            self._aio_channel = self._aio_stub = None

    def close(self) -> None:
        self.channel.close()


def _score_request(request_id: str, token_ids: list[int], top_logprobs: int) -> worker_pb2.ScoreRequest:
    return worker_pb2.ScoreRequest(request_id=request_id, token_ids=common_pb2.TokenIds(ids=token_ids),
                                   top_logprobs=top_logprobs)


def _upstream_score(r: worker_pb2.ScoreResponse) -> UpstreamScore:
    return UpstreamScore(list(r.logprobs), [[(a.token_id, a.logprob) for a in at.alternatives]
                                            for at in r.top_logprobs], r.nll, r.perplexity)
