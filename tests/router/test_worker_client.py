"""The router's grpc.aio client of a worker's Generate, against an in-process fake WorkerService:
events in domain terms, the caller's trace context in the call's metadata, failures translated
(UNAVAILABLE with the generated ids -> WorkerFailed, "draining" -> WorkerRejected), and a cancel
that reaches the worker."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from services.common.errors import InvalidArgument
from services.common.proto import common_pb2, worker_pb2, worker_pb2_grpc
from services.router.admission import RequestCancelled
from services.router.types import FinishReason, SamplingSpec
from services.router.worker_client import (
    GENERATED_IDS_KEY,
    UpstreamFinished,
    UpstreamToken,
    WorkerClient,
    WorkerFailed,
    WorkerRejected,
)

TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


class FakeWorker(worker_pb2_grpc.WorkerServiceServicer):
    """Streams ``len(prompt)`` tokens; the prompt's first id picks a behaviour."""

    def __init__(self) -> None:
        self.metadata: list[dict[str, str]] = []
        self.cancelled = asyncio.Event()

    async def Generate(self, request, context):
        self.metadata.append({k: v for k, v in context.invocation_metadata()})
        mode = request.token_ids.ids[0]
        if mode == 1:  # the group dies after two tokens
            for i in range(2):
                token = common_pb2.GeneratedToken(index=i, token_id=40 + i)
                await context.write(worker_pb2.GenerateResponse(token=token))
            context.set_trailing_metadata(((GENERATED_IDS_KEY, "40,41"),))
            await context.abort(grpc.StatusCode.UNAVAILABLE, "rank 1 of rg-x failed")
        if mode == 2:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the worker is draining")
        if mode == 3:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "prompt too long")
        if mode == 4:  # never finishes: waits for the router to cancel
            await context.write(worker_pb2.GenerateResponse(token=common_pb2.GeneratedToken(index=0, token_id=9)))
            try:
                await asyncio.sleep(30)
            except asyncio.CancelledError:
                self.cancelled.set()
                raise
        top = [common_pb2.TokenLogprob(token_id=7, logprob=-0.5)] if request.sampling.logprobs else []
        for i, _ in enumerate(request.token_ids.ids):
            await context.write(worker_pb2.GenerateResponse(token=common_pb2.GeneratedToken(
                index=i, token_id=100 + i, logprob=-0.25, top_logprobs=top)))
        await context.write(worker_pb2.GenerateResponse(finished=common_pb2.GenerationFinished(
            finish_reason=common_pb2.FINISH_REASON_LENGTH,
            usage=common_pb2.Usage(prompt_tokens=len(request.token_ids.ids),
                                   completion_tokens=len(request.token_ids.ids)))))


def run_with_worker(body) -> FakeWorker:
    worker = FakeWorker()

    async def main() -> None:
        server = grpc.aio.server()
        worker_pb2_grpc.add_WorkerServiceServicer_to_server(worker, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        client = WorkerClient(f"127.0.0.1:{port}")
        try:
            await body(client, worker)
        finally:
            await client.aclose()
            client.close()
            await server.stop(None)

    asyncio.run(main())
    return worker


async def events_of(stream) -> list:
    events = []
    while not events or not isinstance(events[-1], UpstreamFinished):
        events.append(await stream.next())
    return events


def test_events_in_domain_terms_and_the_trace_context_in_the_metadata():
    async def body(client: WorkerClient, worker: FakeWorker) -> None:
        stream = client.generate("r1", [5, 6, 7], SamplingSpec(logprobs=1), (("traceparent", TRACEPARENT),))
        events = await events_of(stream)
        assert events[:-1] == [UpstreamToken(100 + i, -0.25, ((7, -0.5),)) for i in range(3)]
        assert events[-1] == UpstreamFinished(FinishReason.LENGTH, 3, 3, None)
        assert worker.metadata[0]["traceparent"] == TRACEPARENT
        await events_of(client.generate("r2", [5], SamplingSpec()))
        assert "traceparent" not in worker.metadata[1]

    run_with_worker(body)


def test_failures_become_the_routers_errors():
    async def body(client: WorkerClient, worker: FakeWorker) -> None:
        stream = client.generate("r1", [1, 2], SamplingSpec())
        assert [(await stream.next()).token_id for _ in range(2)] == [40, 41]
        with pytest.raises(WorkerFailed, match="rank 1 of rg-x failed") as failed:
            await stream.next()
        assert failed.value.token_ids == [40, 41]
        with pytest.raises(WorkerRejected, match="draining"):
            await client.generate("r2", [2], SamplingSpec()).next()
        with pytest.raises(InvalidArgument, match="prompt too long"):
            await client.generate("r3", [3], SamplingSpec()).next()

    run_with_worker(body)


def test_a_cancel_reaches_the_worker_and_a_pending_read_ends_as_cancelled():
    async def body(client: WorkerClient, worker: FakeWorker) -> None:
        stream = client.generate("r1", [4], SamplingSpec())
        assert (await stream.next()).token_id == 9
        read = asyncio.ensure_future(stream.next())
        await asyncio.sleep(0.05)
        stream.cancel()
        with pytest.raises(RequestCancelled):
            await read
        await asyncio.wait_for(worker.cancelled.wait(), 5)

    run_with_worker(body)
