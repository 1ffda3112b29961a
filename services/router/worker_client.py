"""gRPC client of one replica group's WorkerService, in the router's domain terms.

The only router module besides ``server.py`` that speaks gRPC: Stats answers become
:class:`~services.router.replicas.WorkerStats`, a Generate stream becomes an iterator of
:class:`UpstreamToken` then one :class:`UpstreamFinished`, and a failed call becomes a
ShardlineError (UNAVAILABLE with the worker's ``shardline-generated-token-ids`` trailing
metadata becomes :class:`WorkerFailed`, which carries those ids).
"""

from __future__ import annotations

from collections.abc import Iterator
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


@dataclass(frozen=True, slots=True)
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


def _metadata_ids(call: grpc.Call) -> list[int] | None:
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
    if code == grpc.StatusCode.UNAVAILABLE and isinstance(exc, grpc.Call):
        ids = _metadata_ids(exc)
        if ids is not None:
            return WorkerFailed(f"replica group at {address} failed: {details}", ids)
        if "draining" in details:
            return WorkerRejected(f"worker {address}: {details}")
    return WorkerFailed(f"worker {address}: {code.name}: {details}", [])


class UpstreamStream:
    """One Generate call on a worker; iterate for events, ``cancel()`` from any thread."""

    def __init__(self, call: grpc.Call, address: str) -> None:
        self._call = call
        self.address = address

    def __iter__(self) -> Iterator[UpstreamToken | UpstreamFinished]:
        try:
            for response in self._call:
                if response.HasField("token"):
                    token = response.token
                    yield UpstreamToken(token.token_id, token.logprob,
                                        tuple((t.token_id, t.logprob) for t in token.top_logprobs))
                else:
                    finished = response.finished
                    yield UpstreamFinished(
                        FINISH_FROM_PB.get(finished.finish_reason, FinishReason.ERROR),
                        finished.usage.prompt_tokens, finished.usage.completion_tokens,
                        finished.stop_sequence if finished.HasField("stop_sequence") else None)
                    return
        except grpc.RpcError as exc:
            raise translate_error(exc, self.address) from None

    def cancel(self) -> None:
        self._call.cancel()


class WorkerClient:
    """A channel to one worker, shared by the poller and every stream routed there."""

    def __init__(self, address: str) -> None:
        self.address = address
        self.channel = grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
        self._stub = worker_pb2_grpc.WorkerServiceStub(self.channel)
        self._health = health_pb2_grpc.HealthStub(self.channel)

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

    def generate(self, request_id: str, prompt_ids: list[int], sampling: SamplingSpec) -> UpstreamStream:
        request = worker_pb2.GenerateRequest(request_id=request_id, token_ids=common_pb2.TokenIds(ids=prompt_ids),
                                             sampling=sampling_to_pb(sampling))
        return UpstreamStream(self._stub.Generate(request), self.address)

    def close(self) -> None:
        self.channel.close()
