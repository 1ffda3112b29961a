"""The router's relay on its event loop, against scripted worker streams (no processes): tokens and
the final message, the reservation released however the stream ends, cancels reaching the worker,
failover continuation, the queued admission's thread, the trace context passed on."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from services.common.errors import Unavailable
from services.common.sampling import FinishReason, SamplingParams
from services.router.admission import AdmissionQueue, QueueConfig, RequestCancelled
from services.router.catalog import ModelCatalog, load_served_model
from services.router.routing import Router
from services.router.service import RouterCore
from services.router.types import Finished, GenerationRequest, TokenOut
from services.router.worker_client import UpstreamFinished, UpstreamToken, WorkerFailed
from tests.router.test_routing import replica_set, view

TRACE = (("traceparent", "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"),)


class Script:
    """A worker stream that produces ``tokens`` then finishes, or fails after ``fail_after``; a
    token after ``hold_after`` waits until cancelled."""

    def __init__(self, address: str, prompt_ids: list[int], max_tokens: int, *, fail_after: int | None = None,
                 hold_after: int | None = None) -> None:
        self.address = address
        self.prompt_ids = prompt_ids
        self.max_tokens = max_tokens
        self.fail_after = fail_after
        self.hold_after = hold_after
        self.sent = 0
        self.cancelled = asyncio.Event()
        self.stopped = False  # cancelled because the router matched a stop string

    async def next(self):
        if self.cancelled.is_set():
            raise RequestCancelled("cancelled")
        if self.fail_after is not None and self.sent == self.fail_after:
            raise WorkerFailed(f"replica group at {self.address} failed: rank 1 died", [])
        if self.hold_after is not None and self.sent == self.hold_after:
            await self.cancelled.wait()
            raise RequestCancelled("cancelled")
        if self.sent == self.max_tokens:
            return UpstreamFinished(FinishReason.LENGTH, len(self.prompt_ids), self.sent)
        self.sent += 1
        return UpstreamToken(100 + len(self.prompt_ids) + self.sent, -0.25)

    def cancel(self, *, stop: bool = False) -> None:
        self.stopped = stop
        self.cancelled.set()


class Workers:
    """``open_upstream`` for RouterCore: records each call and scripts its stream."""

    def __init__(self, **behaviour: dict) -> None:
        self.behaviour = behaviour  # address -> Script keyword arguments
        self.opened: list[tuple[str, list[int], SamplingParams, tuple]] = []
        self.streams: list[Script] = []

    def __call__(self, address, request_id, prompt_ids, sampling, trace_context):
        self.opened.append((address, list(prompt_ids), sampling, trace_context))
        stream = Script(address, prompt_ids, sampling.max_tokens, **self.behaviour.get(address, {}))
        self.streams.append(stream)
        return stream


@pytest.fixture(scope="module")
def catalog(tiny_model_dir: Path) -> ModelCatalog:
    return ModelCatalog([load_served_model(tiny_model_dir, name="m")])


def core_over(catalog: ModelCatalog, workers: Workers, *views, max_wait_s: float = 5.0) -> RouterCore:
    replicas = replica_set(*(views or (view("a"),)))
    router = Router(replicas)
    return RouterCore(catalog, replicas, router, AdmissionQueue(replicas, router, QueueConfig(max_wait_s=max_wait_s)),
                      workers)


def request(max_tokens: int = 5, prompt: tuple[int, ...] = (5, 6, 7)) -> GenerationRequest:
    return GenerationRequest(model="m", prompt_ids=prompt, sampling=SamplingParams(max_tokens=max_tokens),
                             trace_context=TRACE)


def reserved(core: RouterCore) -> int:
    return sum(v.kv_bytes_reserved for v in core.replicas.views())


def test_tokens_then_finished_and_the_reservation_is_released(catalog):
    workers = Workers()
    core = core_over(catalog, workers)

    async def run() -> list:
        return [event async for event in await core.generate(request(max_tokens=5))]

    events = asyncio.run(run())
    tokens, final = events[:-1], events[-1]
    assert [t.index for t in tokens] == list(range(5)) and all(isinstance(t, TokenOut) for t in tokens)
    assert isinstance(final, Finished) and (final.reason, final.prompt_tokens, final.completion_tokens) == \
        (FinishReason.LENGTH, 3, 5)
    assert final.timings.total_ns >= final.timings.time_to_first_token_ns > 0
    assert workers.opened[0][3] == TRACE  # the caller's trace context goes to the worker
    assert reserved(core) == 0


def test_a_client_cancel_reaches_the_worker_and_releases_the_reservation(catalog):
    workers = Workers(**{"a:1": {"hold_after": 2}})
    core = core_over(catalog, workers)

    async def run() -> list:
        generation = await core.generate(request(max_tokens=50))
        got: list = []

        async def consume() -> None:
            async for event in generation:
                got.append(event)

        task = asyncio.ensure_future(consume())
        while len(got) < 2:
            await asyncio.sleep(0)
        assert reserved(core) > 0
        task.cancel()  # what grpc.aio does to the handler when its client cancels
        with pytest.raises(asyncio.CancelledError):
            await task
        return got

    assert len(asyncio.run(run())) == 2
    assert workers.streams[0].cancelled.is_set() and reserved(core) == 0


def test_a_consumer_that_stops_between_events_cancels_the_worker_through_close(catalog):
    workers = Workers()
    core = core_over(catalog, workers)

    async def run() -> None:
        generation = await core.generate(request(max_tokens=50))
        events = generation.__aiter__()
        await events.__anext__()
        generation.close()  # a front door's finally, with the relay suspended at its yield
        await events.aclose()

    asyncio.run(run())
    assert workers.streams[0].cancelled.is_set() and reserved(core) == 0


def test_a_group_that_fails_mid_stream_is_marked_and_the_request_continues_elsewhere(catalog):
    workers = Workers(**{"a:1": {"fail_after": 3}})
    a = view("a")
    core = core_over(catalog, workers, a, view("b", used_tokens=10))

    async def run() -> list:
        generation = await core.generate(request(max_tokens=8))
        return [(event, generation.replica_group_id) async for event in generation]

    events = asyncio.run(run())
    assert [e.index for e, _ in events[:-1]] == list(range(8))
    assert [g for _, g in events] == ["a"] * 3 + ["b"] * 6
    (first, prompt_a, _, _), (second, prompt_b, sampling_b, trace_b) = workers.opened
    assert (first, second) == ("a:1", "b:1")
    assert prompt_b == prompt_a + [e.token_id for e, _ in events[:3]] and sampling_b.max_tokens == 5
    assert trace_b == TRACE
    assert events[-1][0].completion_tokens == 8 and events[-1][0].prompt_tokens == 3
    assert a.failed and reserved(core) == 0


def test_each_continuation_carries_the_remaining_budget_and_the_sampling_step(catalog):
    """max_tokens counts across groups, and first_step grows by the tokens generated before each
    continuation (from the request's own first_step), so a seeded stream resumes where it stopped."""
    workers = Workers(**{"a:1": {"fail_after": 3}, "b:1": {"fail_after": 2}})
    core = core_over(catalog, workers, view("a"), view("b", used_tokens=10), view("c", used_tokens=20))
    sampling = SamplingParams(temperature=0.8, seed=7, max_tokens=10, first_step=4)

    async def run() -> list:
        generation = await core.generate(GenerationRequest(model="m", prompt_ids=(5, 6, 7), sampling=sampling))
        return [event async for event in generation]

    events = asyncio.run(run())
    assert [e.index for e in events[:-1]] == list(range(10))
    assert [(address, len(prompt), s.max_tokens, s.first_step, s.seed) for address, prompt, s, _ in workers.opened] \
        == [("a:1", 3, 10, 4, 7), ("b:1", 6, 7, 7, 7), ("c:1", 8, 5, 9, 7)]
    assert (events[-1].reason, events[-1].completion_tokens) == (FinishReason.LENGTH, 10)
    assert reserved(core) == 0


def test_a_stop_string_straddling_the_failure_point_ends_the_request(catalog):
    """The tiny tokenizer's ids 104, 105, ... are "d", "e", ...: group a streams "def" and fails,
    group b's first token "g" completes the stop string "fg". Group b only sees "def" as prompt,
    so it is the router's detokenizer, over every generated token, that ends the request, with
    the events of the same request on a group that does not fail."""
    sampling = SamplingParams(max_tokens=20, stop=("fg",))

    def run(workers: Workers) -> list:
        core = core_over(catalog, workers, view("a"), view("b", used_tokens=10))

        async def relay() -> list:
            generation = await core.generate(GenerationRequest(model="m", prompt_ids=(5, 6, 7), sampling=sampling))
            return [event async for event in generation]

        events = asyncio.run(relay())
        assert reserved(core) == 0
        return [(t.token_id, t.text) for t in events[:-1]] + [(events[-1].reason, events[-1].completion_tokens,
                                                               events[-1].text)]

    workers = Workers(**{"a:1": {"fail_after": 3}})
    events = run(workers)
    assert events[:4] == [(104, "d"), (105, "e"), (106, "f"), (107, "")]
    assert events[4] == (FinishReason.STOP_SEQUENCE, 4, "de") and len(events) == 5
    assert events == run(Workers())
    assert [address for address, *_ in workers.opened] == ["a:1", "b:1"]
    # the workers get no stop strings (the router matches them); the one that produced the last
    # token is told the request stopped there
    assert [opened[2].stop for opened in workers.opened] == [(), ()]
    assert workers.streams[1].cancelled.is_set() and workers.streams[1].stopped


def test_a_stop_string_ends_the_request_at_its_token_and_names_itself(catalog):
    """The router ends the stream on the token that completes a stop string (without waiting for
    the worker), tells the worker why, and says which stop string it was."""
    workers = Workers()
    core = core_over(catalog, workers)
    sampling = SamplingParams(max_tokens=20, stop=("zz", "ef"))

    async def run() -> list:
        generation = await core.generate(GenerationRequest(model="m", prompt_ids=(5, 6, 7), sampling=sampling))
        return [event async for event in generation]

    events = asyncio.run(run())
    final = events[-1]
    assert [t.text for t in events[:-1]] == ["d", "e", ""]
    assert (final.reason, final.completion_tokens, final.stop_sequence, final.text) == \
        (FinishReason.STOP_SEQUENCE, 3, "ef", "d")
    assert workers.streams[0].sent == 3 and workers.streams[0].stopped and reserved(core) == 0


def test_a_request_complete_when_its_group_fails_is_not_continued(catalog):
    """The failed group streamed the whole budget before it failed."""
    workers = Workers(**{"a:1": {"fail_after": 3}})
    a = view("a")
    core = core_over(catalog, workers, a, view("b", used_tokens=10))

    async def run() -> list:
        generation = await core.generate(GenerationRequest(model="m", prompt_ids=(5, 6, 7),
                                                           sampling=SamplingParams(max_tokens=3)))
        return [event async for event in generation]

    events = asyncio.run(run())
    assert (events[-1].reason, events[-1].completion_tokens) == (FinishReason.LENGTH, 3)
    assert [address for address, *_ in workers.opened] == ["a:1"] and a.failed and reserved(core) == 0


def test_a_queued_request_waits_on_a_thread_and_is_placed_when_headroom_returns(catalog):
    workers = Workers()
    core = core_over(catalog, workers, view("a", capacity_tokens=64))
    hog = core.router.try_reserve("m", 30, 30)

    async def run() -> list:
        generation = await core.generate(request(max_tokens=20))
        start = asyncio.ensure_future(generation.start())
        await asyncio.sleep(0.2)
        assert not start.done() and core.admission.depth("m") == 1  # queued, and the loop still runs
        core.router.release(hog)
        await asyncio.wait_for(start, 5)
        return [event async for event in generation]

    assert len(asyncio.run(run())) == 21
    assert core.admission.depth() == 0 and reserved(core) == 0


def test_a_queued_request_whose_client_goes_away_leaves_the_queue(catalog):
    workers = Workers()
    core = core_over(catalog, workers, view("a", capacity_tokens=64))
    hog = core.router.try_reserve("m", 30, 30)

    async def run() -> None:
        generation = await core.generate(request(max_tokens=20))
        start = asyncio.ensure_future(generation.start())
        await asyncio.sleep(0.2)
        start.cancel()
        with pytest.raises(asyncio.CancelledError):
            await start
        for _ in range(100):  # the thread sees the cancel at once (admission wakes it)
            if core.admission.depth() == 0:
                break
            await asyncio.sleep(0.01)

    asyncio.run(run())
    assert core.admission.depth() == 0 and workers.opened == []
    core.router.release(hog)
    assert reserved(core) == 0


def test_a_stream_that_ends_without_its_final_message_is_unavailable(catalog):
    class Truncated(Workers):
        def __call__(self, *args):
            stream = super().__call__(*args)

            async def eof():
                raise Unavailable("worker a:1 ended the stream without a final message")

            stream.next = eof
            return stream

    core = core_over(catalog, Truncated())

    async def run() -> None:
        async for _ in await core.generate(request()):
            pass

    with pytest.raises(Unavailable, match="without a final message"):
        asyncio.run(run())
    assert reserved(core) == 0
