"""gRPC client of one replica group's WorkerService, in the router's domain terms.

The only router module besides ``server.py`` that speaks gRPC: Stats answers become
:class:`~services.router.replicas.WorkerStats`, a Generate stream becomes an
:class:`UpstreamStream` whose ``await next()`` gives :class:`UpstreamToken` events then one
:class:`UpstreamFinished`, and a failed call becomes a ShardlineError (UNAVAILABLE with the
worker's ``shardline-generated-token-ids`` trailing metadata becomes :class:`WorkerFailed`, which
carries those ids).

Two channels per worker: a blocking one for the poller thread's Stats and health checks, and a
grpc.aio one, made on the router's event loop, for the Generate streams that the loop relays.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.errors import InvalidArgument, NotFound, ResourceExhausted, ShardlineError, Unavailable
from services.common.proto import common_pb2, worker_pb2, worker_pb2_grpc
from services.router.admission import RequestCancelled
from services.router.replicas import WorkerStats
from services.router.types import FinishReason, SamplingSpec

GENERATED_IDS_KEY = "shardline-generated-token-ids"  # the worker's trailing metadata key
DTYPE_NAMES = {common_pb2.DTYPE_FLOAT32: "float32", common_pb2.DTYPE_BFLOAT16: "bfloat16",
               common_pb2.DTYPE_FLOAT16: "float16", common_pb2.DTYPE_INT8: "int8", common_pb2.DTYPE_FP8: "fp8"}
FINISH_FROM_PB = {
    common_pb2.FINISH_REASON_LENGTH: FinishReason.LENGTH,
    common_pb2.FINISH_REASON_EOS_TOKEN: FinishReason.EOS_TOKEN,
    common_pb2.FINISH_REASON_STOP_SEQUENCE: FinishReason.STOP_SEQUENCE,
    common_pb2.FINISH_REASON_CANCELLED: FinishReason.CANCELLED,
    common_pb2.FINISH_REASON_ERROR: FinishReason.ERROR,
}
CHANNEL_OPTIONS = [("grpc.keepalive_time_ms", 10_000), ("grpc.keepalive_timeout_ms", 5_000),
                   ("grpc.http2.max_pings_without_data", 0)]


class WorkerFailed(Unavailable):
    """The group failed mid-stream; ``token_ids`` are the ones it had produced."""

    def __init__(self, message: str, token_ids: list[int]) -> None:
        super().__init__(message)
        self.token_ids = token_ids


class WorkerRejected(Unavailable):
    """The worker refused the request before producing anything (draining, stopping)."""


@dataclass(slots=True)  # one per relayed token: not frozen, which would cost a setattr call per field
class UpstreamToken:
    token_id: int
    logprob: float
    top_logprobs: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True, slots=True)
class UpstreamFinished:
    reason: FinishReason
    prompt_tokens: int
    completion_tokens: int
    stop_sequence: str | None = None


def sampling_to_pb(spec: SamplingSpec) -> common_pb2.SamplingParameters:
    pb = common_pb2.SamplingParameters(
        temperature=spec.temperature, top_p=spec.top_p, top_k=spec.top_k, max_tokens=spec.max_tokens,
        stop=list(spec.stop), stop_token_ids=list(spec.stop_token_ids), logprobs=spec.logprobs,
        ignore_eos=spec.ignore_eos)
    if spec.seed is not None:
        pb.seed = spec.seed
    return pb


def _metadata_ids(call: grpc.Call | grpc.aio.AioRpcError) -> list[int] | None:
    for key, value in call.trailing_metadata() or ():
        if key == GENERATED_IDS_KEY:
            return [int(t) for t in value.split(",") if t]
    return None


def translate_error(exc: grpc.RpcError, address: str) -> ShardlineError:
    """A worker's failed call as the domain error the router's client should see."""
    code, details = exc.code(), exc.details() or ""
    if code == grpc.StatusCode.CANCELLED:
        return RequestCancelled(f"the call to worker {address} was cancelled")
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        return InvalidArgument(details)
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return ResourceExhausted(details)
    if code == grpc.StatusCode.NOT_FOUND:
        return NotFound(details)
    if code == grpc.StatusCode.UNAVAILABLE and hasattr(exc, "trailing_metadata"):
        ids = _metadata_ids(exc)
        if ids is not None:
            return WorkerFailed(f"replica group at {address} failed: {details}", ids)
        if "draining" in details:
            return WorkerRejected(f"worker {address}: {details}")
    return WorkerFailed(f"worker {address}: {code.name}: {details}", [])



class UpstreamStream:
    """One Generate call on a worker, on the router's event loop: ``await next()`` for each event
    (after UpstreamFinished, do not call it again); ``cancel()`` stops the worker's sequence."""

    __slots__ = ("_call", "address")

    def __init__(self, call: grpc.aio.UnaryStreamCall, address: str) -> None:
        self._call = call
        self.address = address

    async def next(self) -> UpstreamToken | UpstreamFinished:
        """The next event; raises the call's failure as a ShardlineError (``translate_error``),
        RequestCancelled if the call was cancelled through ``cancel()``, and Unavailable if the
        stream ends without its final message."""
        try:
            response = await self._call.read()
        except grpc.RpcError as exc:
            raise translate_error(exc, self.address) from None
        except asyncio.CancelledError:
            # grpc.aio raises CancelledError for a read of a call cancelled locally; only a
            # cancel of our own task is a task cancellation
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                raise
            raise RequestCancelled(f"the call to worker {self.address} was cancelled") from None
        if response is grpc.aio.EOF:
            raise Unavailable(f"worker {self.address} ended the stream without a final message")
        if response.HasField("token"):
            token = response.token
            top = token.top_logprobs
            return UpstreamToken(token.token_id, token.logprob,
                                 tuple([(t.token_id, t.logprob) for t in top]) if top else ())
        finished = response.finished
        return UpstreamFinished(
            FINISH_FROM_PB.get(finished.finish_reason, FinishReason.ERROR),
            finished.usage.prompt_tokens, finished.usage.completion_tokens,
            finished.stop_sequence if finished.HasField("stop_sequence") else None)

    def cancel(self) -> None:
        self._call.cancel()


class WorkerClient:
    """The channels to one worker, shared by its poller and every stream routed there."""

    def __init__(self, address: str) -> None:
        self.address = address
        self.channel = grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
        self._stub = worker_pb2_grpc.WorkerServiceStub(self.channel)
        self._health = health_pb2_grpc.HealthStub(self.channel)
        self._aio_channel: grpc.aio.Channel | None = None
        self._aio_stub: worker_pb2_grpc.WorkerServiceStub | None = None

    def stats(self, timeout_s: float) -> WorkerStats:
        try:
            r = self._stub.Stats(worker_pb2.StatsRequest(), timeout=timeout_s)
        except grpc.RpcError as exc:
            raise Unavailable(f"Stats of {self.address}: {exc.code().name}: {exc.details()}") from None
        return WorkerStats(
            replica_group_id=r.replica_group_id, model_name=r.model_name, tp_degree=r.layout.tp_degree,
            pp_degree=r.layout.pp_degree, dtype=DTYPE_NAMES.get(r.layout.dtype, ""),
            kv_bytes_used=r.kv_bytes_used, kv_bytes_capacity=r.kv_bytes_capacity,
            kv_bytes_per_token=r.kv_bytes_per_token, max_model_len=r.max_model_len, running=r.running,
            waiting=r.waiting, blocks_used=r.blocks_used, blocks_total=r.blocks_total, draining=r.draining)

    def serving(self, timeout_s: float) -> bool:
        try:
            response = self._health.Check(health_pb2.HealthCheckRequest(service=""), timeout=timeout_s)
        except grpc.RpcError:
            return False
        return response.status == health_pb2.HealthCheckResponse.SERVING

    def generate(self, request_id: str, prompt_ids: list[int], sampling: SamplingSpec,
                 metadata: Sequence[tuple[str, str]] = ()) -> UpstreamStream:
        """Open a Generate stream (on the router's event loop, which the call then belongs to);
        ``metadata`` goes with the call (the caller's trace context)."""
        stub = self._aio_stub
        if stub is None:
            self._aio_channel = grpc.aio.insecure_channel(self.address, options=CHANNEL_OPTIONS)
            stub = self._aio_stub = worker_pb2_grpc.WorkerServiceStub(self._aio_channel)
        request = worker_pb2.GenerateRequest(request_id=request_id, token_ids=common_pb2.TokenIds(ids=prompt_ids),
                                             sampling=sampling_to_pb(sampling))
        return UpstreamStream(stub.Generate(request, metadata=tuple(metadata) or None), self.address)

    async def aclose(self) -> None:
        """Close the event loop's channel (on that loop)."""
        if self._aio_channel is not None:
            await self._aio_channel.close()
            self._aio_channel = self._aio_stub = None

    def close(self) -> None:
        self.channel.close()
