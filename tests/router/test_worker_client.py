"""The router's grpc.aio client of a worker's Relay stream, against an in-process fake
WorkerService: events in domain terms, requests multiplexed on one stream with one message
carrying several requests' events, the caller's trace context in the submit, failures translated
(UNAVAILABLE with the generated ids -> WorkerFailed, "draining" -> WorkerRejected), a cancel
that reaches the worker, and a broken stream failing its requests and replaced for the next."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from services.common.errors import InvalidArgument
from services.common.proto import common_pb2, worker_pb2, worker_pb2_grpc
from services.common.sampling import FinishReason, SamplingParams
from services.router.admission import RequestCancelled
from services.router.worker_client import UpstreamFinished, UpstreamToken, WorkerClient, WorkerFailed, WorkerRejected

TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
UNAVAILABLE = grpc.StatusCode.UNAVAILABLE.value[0]


def token(relay_id: int, token_id: int, logprob: float = 0.0, top=()) -> worker_pb2.RelayEvent:
    return worker_pb2.RelayEvent(relay_id=relay_id, token=common_pb2.GeneratedToken(
        token_id=token_id, logprob=logprob, top_logprobs=[common_pb2.TokenLogprob(token_id=t, logprob=lp)
                                                          for t, lp in top]))


def finished(relay_id: int, n_prompt: int, n_out: int) -> worker_pb2.RelayEvent:
    return worker_pb2.RelayEvent(relay_id=relay_id, finished=common_pb2.GenerationFinished(
        finish_reason=common_pb2.FINISH_REASON_LENGTH,
        usage=common_pb2.Usage(prompt_tokens=n_prompt, completion_tokens=n_out)))


def error(relay_id: int, code: int, message: str, generated: list[int] | None = None) -> worker_pb2.RelayEvent:
    pb = worker_pb2.RelayEvent(relay_id=relay_id, error=worker_pb2.RelayError(code=code, message=message))
    if generated is not None:
        pb.error.generated.SetInParent()
        pb.error.generated.ids.extend(generated)
    return pb


class FakeWorker(worker_pb2_grpc.WorkerServiceServicer):
    """A Relay stream whose requests' first prompt id picks a behaviour (1-4, 70/71, 90; others
    stream len(prompt) tokens); a request's events of the same "step" go out in one message."""

    def __init__(self) -> None:
        self.submits: list[worker_pb2.RelaySubmit] = []
        self.cancelled: list[int] = []
        self.streams = 0
        self.held: list[int] = []
        self.cancel_seen = asyncio.Event()

    async def Relay(self, request_iterator, context):
        self.streams += 1
        out: asyncio.Queue = asyncio.Queue()

        async def read() -> None:
            async for message in request_iterator:
                if message.HasField("cancel"):
                    self.cancelled.append(message.cancel.relay_id)
                    self.cancel_seen.set()
                    continue
                self.submits.append(message.submit)
                self.script(message.submit, out)

        reader = asyncio.ensure_future(read())
        try:
            while True:
                events = await out.get()
                if isinstance(events, str):
                    await context.abort(grpc.StatusCode.UNAVAILABLE, "connection reset")
                await context.write(worker_pb2.RelayResponse(events=events))
        finally:
            reader.cancel()

    def script(self, submit: worker_pb2.RelaySubmit, out: asyncio.Queue) -> None:
        rid, ids = submit.relay_id, list(submit.request.token_ids.ids)
        mode = ids[0]
        if mode == 1:  # the group dies after two tokens
            out.put_nowait([token(rid, 40), token(rid, 41)])
            out.put_nowait([error(rid, UNAVAILABLE, "rank 1 of rg-x failed", [40, 41])])
        elif mode == 2:
            out.put_nowait([error(rid, UNAVAILABLE, "replica group rg-x is draining")])
        elif mode == 3:
            out.put_nowait([error(rid, grpc.StatusCode.INVALID_ARGUMENT.value[0], "prompt too long")])
        elif mode == 4:  # one token, then nothing until the router cancels
            out.put_nowait([token(rid, 9)])
        elif mode == 70:  # held until a mode-71 request sends one message for all of them
            self.held.append(rid)
        elif mode == 71:
            rids = [*self.held, rid]
            self.held.clear()
            out.put_nowait([token(r, 200 + r) for r in rids] + [finished(r, 1, 1) for r in rids])
        elif mode == 90:  # one token, then the stream breaks
            out.put_nowait([token(rid, 9)])
            out.put_nowait("break")
        else:  # len(prompt) tokens in one message per step, then the finish with the last token
            top = ((7, -0.5),) if submit.request.sampling.logprobs else ()
            for i in range(len(ids)):
                step = [token(rid, 100 + i, -0.25, top)]
                out.put_nowait(step + [finished(rid, len(ids), len(ids))] if i == len(ids) - 1 else step)


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


def test_events_in_domain_terms_and_the_trace_context_in_the_submit():
    async def body(client: WorkerClient, worker: FakeWorker) -> None:
        stream = client.generate("r1", [5, 6, 7], SamplingParams(logprobs=1),
                                 trace_context=(("traceparent", TRACEPARENT),))
        events = await events_of(stream)
        assert events[:-1] == [UpstreamToken(100 + i, -0.25, ((7, -0.5),)) for i in range(3)]
        assert events[-1] == UpstreamFinished(FinishReason.LENGTH, 3, 3)
        await events_of(client.generate("r2", [5], SamplingParams()))
        first, second = worker.submits
        assert first.trace_context["traceparent"] == TRACEPARENT and "traceparent" not in second.trace_context
        assert first.request.request_id == "r1" and list(first.request.token_ids.ids) == [5, 6, 7]
        assert first.relay_id != second.relay_id and worker.streams == 1  # one stream for both

    run_with_worker(body)


def test_concurrent_requests_share_the_stream():
    async def body(client: WorkerClient, worker: FakeWorker) -> None:
        streams = [client.generate(f"r{i}", [10 + i] * (i + 2), SamplingParams()) for i in range(5)]
        results = await asyncio.gather(*(events_of(s) for s in streams))
        for i, events in enumerate(results):
            assert [e.token_id for e in events[:-1]] == [100 + j for j in range(i + 2)]
            assert events[-1].completion_tokens == i + 2
        assert worker.streams == 1 and len(worker.submits) == 5
        # one message with the events of four requests: each gets its own
        held = [client.generate(f"h{i}", [70], SamplingParams()) for i in range(3)]
        results = await asyncio.gather(*(events_of(s) for s in [*held, client.generate("h", [71], SamplingParams())]))
        assert [[e.token_id for e in events[:-1]] for events in results] == \
            [[200 + s.relay_id] for s in held] + [[200 + held[-1].relay_id + 1]]
        assert all(events[-1].completion_tokens == 1 for events in results)

    run_with_worker(body)


def test_failures_become_the_routers_errors():
    async def body(client: WorkerClient, worker: FakeWorker) -> None:
        stream = client.generate("r1", [1, 2], SamplingParams())
        assert [(await stream.next()).token_id for _ in range(2)] == [40, 41]
        with pytest.raises(WorkerFailed, match="rank 1 of rg-x failed") as failed:
            await stream.next()
        assert failed.value.token_ids == [40, 41]
        with pytest.raises(WorkerRejected, match="draining"):
            await client.generate("r2", [2], SamplingParams()).next()
        with pytest.raises(InvalidArgument, match="prompt too long"):
            await client.generate("r3", [3], SamplingParams()).next()
        assert len(await events_of(client.generate("r4", [8, 8], SamplingParams()))) == 3  # the stream lives on
        assert worker.streams == 1

    run_with_worker(body)


def test_a_cancel_reaches_the_worker_and_a_pending_read_ends_as_cancelled():
    async def body(client: WorkerClient, worker: FakeWorker) -> None:
        stream = client.generate("r1", [4], SamplingParams())
        assert (await stream.next()).token_id == 9
        read = asyncio.ensure_future(stream.next())
        await asyncio.sleep(0.05)
        stream.cancel()
        with pytest.raises(RequestCancelled):
            await read
        await asyncio.wait_for(worker.cancel_seen.wait(), 5)
        assert worker.cancelled == [stream.relay_id]
        stream.cancel()  # again: nothing more is sent
        finished = await events_of(client.generate("r2", [6, 6], SamplingParams()))
        assert len(finished) == 3 and worker.cancelled == [stream.relay_id]

    run_with_worker(body)


def test_a_broken_stream_fails_its_requests_and_the_next_request_opens_a_new_one():
    async def body(client: WorkerClient, worker: FakeWorker) -> None:
        holding = client.generate("r1", [4], SamplingParams())
        assert (await holding.next()).token_id == 9
        breaking = client.generate("r2", [90], SamplingParams())
        assert (await breaking.next()).token_id == 9
        for stream in (holding, breaking):
            with pytest.raises(WorkerFailed, match="relay stream UNAVAILABLE: connection reset") as failed:
                await stream.next()
            assert failed.value.token_ids == []
        assert len(await events_of(client.generate("r3", [6, 6], SamplingParams()))) == 3
        assert worker.streams == 2

    run_with_worker(body)
