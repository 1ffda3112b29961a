"""The router's request path: prepare (tokenize, validate), admit, relay the worker's stream.

:class:`RouterCore` is what both front doors call (gRPC ``server.py`` and the OpenAI HTTP
app), all on the router's one event loop. A :class:`Generation` is one request: ``await
start()`` admits it and opens the stream on the chosen group (a request that has to wait in the
admission queue waits on a thread of its own, so the loop never blocks); ``async for`` relays
tokens with the router's own incremental detokenization; ``cancel()`` (client cancel or
disconnect) cancels the upstream request, which frees the worker's blocks; ``close()``, which the
relay and the front doors call however the request ends, releases the reservation.

If the group fails mid-stream (the worker ends the request with UNAVAILABLE), the group is marked
failed and the request continues on another group: prompt + the tokens already streamed
become the new prompt, ``max_tokens`` shrinks by as many and ``first_step`` grows by as many (a
seeded request's sampler resumes its random stream where the failed group left it, so the
continued tokens are those of a fault-free run), and the client sees one unbroken stream
(``replica_group_id`` changes on the messages that follow: it always names the group that
produced the token at hand; ``replica_group_ids`` lists every group that produced some). Stop
strings are matched only here, by the router's own detokenizer over every generated token (a new
group sees the earlier ones only as prompt), so a stop string that straddles the failure point
still ends the request, and a request already complete when its group fails is not continued. The
workers get no stop strings and make no text; a match ends the stream at that token and cancels
the upstream request with reason stop. A request
that cannot continue (no healthy group left, or ``max_continuations`` spent) raises the failure
(UNAVAILABLE), which each front door turns into its error: a gRPC status, an SSE error event
before ``[DONE]``.

Per relayed token the loop does only what the client needs: one await on the request's upstream
stream (``worker_client.py`` reads the worker's Relay stream once per engine step for all the
requests on it), the detokenizer (``services/common/detokenizer.py``: one dict lookup for most tokens), one TokenOut.
No locks, no metrics and no logging per token: metrics are counted per request. A request picked
for shadow traffic (``shadow.py``) also keeps each token's logprob (one list append); when it has
finished normally, ``close()`` offers it to the mirror, after the client's stream has ended.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from functools import partial
from typing import TypeVar

from services.common.detokenizer import Detokenizer
from services.common.errors import InvalidArgument, ResourceExhausted, Unimplemented
from services.common.sampling import MAX_LOGPROBS, FinishReason, SamplingParams, is_integer
from services.router.admission import AdmissionQueue, RequestCancelled
from services.router.catalog import ModelCatalog
from services.router.metrics import RouterMetrics
from services.router.prepare import Prepared, check_prompt, prepared_request
from services.router.replicas import ReplicaGroupView, ReplicaSet, Reservation
from services.router.routing import PromptPrefix, Router
from services.router.shadow import ShadowJob, ShadowMirror
from services.router.types import Finished, GenerationRequest, Scored, Timings, TokenAlternative, TokenOut
from services.router.worker_client import (
    UpstreamFinished,
    UpstreamScore,
    UpstreamStream,
    WorkerFailed,
    WorkerFull,
    WorkerRejected,
)

log = logging.getLogger(__name__)
T = TypeVar("T")

DEFAULT_MAX_CONTINUATIONS = 2
# Text prompts up to this many characters are tokenized on the event loop (~3 ms with the tiny
# model's tokenizer); longer ones on the router's prepare threads, with the GIL released.
INLINE_ENCODE_CHARS = 8192
PREPARE_THREADS = 2
# a request that ended one of these ways is mirrored (when picked), unless it was continued on
# another group after a failover: every token it streamed was sampled by one incumbent group
MIRRORED_REASONS = frozenset({FinishReason.EOS_TOKEN, FinishReason.STOP_SEQUENCE, FinishReason.LENGTH})


# (address, request_id, prompt ids, sampling, trace context) -> the request's stream on that worker
OpenUpstream = Callable[[str, str, list[int], SamplingParams, tuple[tuple[str, str], ...]], UpstreamStream]
# (address, request_id, token ids, top logprobs) -> the worker's Score answer
ScoreUpstream = Callable[[str, str, list[int], int], Awaitable[UpstreamScore]]


class RouterCore:
    def __init__(self, catalog: ModelCatalog, replicas: ReplicaSet, router: Router, admission: AdmissionQueue,
                 open_upstream: OpenUpstream, *,
                 metrics: RouterMetrics | None = None,
                 max_continuations: int = DEFAULT_MAX_CONTINUATIONS,
                 score_upstream: ScoreUpstream | None = None, shadow: ShadowMirror | None = None) -> None:
        self.catalog = catalog
        self.replicas = replicas
        self.router = router
        self.admission = admission
        self.open_upstream = open_upstream
        self.score_upstream = score_upstream
        self.metrics = metrics
        self.max_continuations = max_continuations
        self.shadow = shadow  # mirrors a share of the finished requests to candidate groups
        # tokenizing and chat templating of large inputs, off the event loop (a few threads: the
        # work is CPU, and a queue of it must not take the machine from the workers)
        self.executor = ThreadPoolExecutor(max_workers=PREPARE_THREADS, thread_name_prefix="router-prepare")

    async def off_loop(self, fn: Callable[..., T], /, *args: object, **kwargs: object) -> T:
        """``fn(*args, **kwargs)`` on the prepare threads, awaited."""
        return await asyncio.get_running_loop().run_in_executor(self.executor, partial(fn, *args, **kwargs))

    async def prepare(self, request: GenerationRequest, *, token_texts: bool = False) -> Prepared:
        """Validate and tokenize; raises NotFound / InvalidArgument (nothing is reserved yet). A
        long text is tokenized on the prepare threads, so that the event loop keeps relaying other
        requests' tokens meanwhile."""
        model = self.catalog.get(request.model)
        text = check_prompt(model, request)
        ids = None
        if text is not None and len(text) <= INLINE_ENCODE_CHARS:
            ids = model.encode(text, add_special_tokens=request.add_special_tokens)
        elif text is not None:
            ids = await self.off_loop(model.encode, text, add_special_tokens=request.add_special_tokens,
                                      release_gil=True)
        return prepared_request(model, request, ids, token_texts)

    async def generate(self, request: GenerationRequest, *, token_texts: bool = False) -> Generation:
        """A generation of ``request``, prepared (a long prompt is tokenized off the event loop)."""
        return Generation(self, await self.prepare(request, token_texts=token_texts))

    async def score(self, request: GenerationRequest, top_logprobs: int = 0) -> Scored:
        """The prompt's per-token logprobs (and ``top_logprobs`` alternatives) from a healthy
        group; ``request.sampling`` is not used. A one-token prompt has nothing to score."""
        if not is_integer(top_logprobs) or not 0 <= top_logprobs <= MAX_LOGPROBS:
            raise InvalidArgument(f"top_logprobs must be an integer in [0, {MAX_LOGPROBS}], got {top_logprobs!r}")
        prepared = await self.prepare(request)
        if len(prepared.prompt_ids) < 2:
            return Scored(prepared.request_id, "", list(prepared.prompt_ids),
                          [prepared.model.token_text(t) for t in prepared.prompt_ids], [], [], 0.0, 1.0)
        return await Generation(self, prepared).score(top_logprobs)

    def groups(self, model: str = "") -> list[ReplicaGroupView]:
        with self.replicas.lock:
            views = [v for v in self.replicas.views() if not model or v.model == model]
            return sorted(views, key=lambda v: (v.replica_group_id, v.address))


class Generation:
    """One request through the router (see the module docstring). Everything but the queued
    admission's thread runs on the event loop."""

    def __init__(self, core: RouterCore, prepared: Prepared) -> None:
        self.core = core
        self.prepared = prepared
        self.request_id = prepared.request_id
        self.cancelled = threading.Event()  # also read by a queued admission's thread
        self.reservation: Reservation | None = None
        self.replica_group_id = ""  # the group the stream is on now: the one that produces the next token
        self.replica_group_ids: list[str] = []  # the groups that produced its tokens, in order
        self.arrival_ns = time.monotonic_ns()
        self.admitted_ns = 0
        self._upstream: UpstreamStream | None = None
        self._started = False
        self._queued = False  # an admission thread is waiting in the queue for us
        self._done = False  # the stream has ended, whatever the way
        self._finished = False  # a final event was produced (the worker needs no cancel)
        self._failure_counted = False
        self._continued_from = 0  # tokens generated before the current upstream stream
        self._running_on = ""  # group counted in the running-requests gauge
        # the incumbent's logprob of each generated token, kept only for a request picked for mirroring
        shadow = core.shadow
        self._shadow_logprobs: list[float] | None = [] if shadow is not None and shadow.wants() else None
        self._shadow_job: ShadowJob | None = None  # offered to the mirror by close()

    @property
    def prompt_tokens(self) -> int:
        return len(self.prepared.prompt_ids)

    async def start(self) -> None:
        """Admit (may wait in the queue) and open the stream; raises the admission errors."""
        if self._started:
            return
        self._started = True
        p = self.prepared
        try:
            self.reservation = await self._admit(len(p.prompt_ids), p.sampling.max_tokens,
                                                 PromptPrefix(p.prompt_ids, p.sampling.cache_salt))
            self.admitted_ns = time.monotonic_ns()
            self._open(p.prompt_ids, p.sampling)
        except BaseException as exc:
            self._finish_reservation()
            self._count_failure(exc)
            raise

    async def score(self, top_logprobs: int) -> Scored:
        """The prompt's logprobs instead of a generation: admitted like a request that generates
        nothing (its prompt's KV must fit: the worker prefills it), scored by the group's Score,
        released. A group that fails is marked failed and the prompt scored on another."""
        if self._started:
            raise RuntimeError("a request is scored or generated, once")
        if self.core.score_upstream is None:
            raise Unimplemented("this router cannot score prompts")
        self._started = True
        p = self.prepared
        failovers = 0
        try:
            while True:
                self.reservation = await self._admit(len(p.prompt_ids), 0)
                self.admitted_ns = time.monotonic_ns()
                group = self.reservation.group
                self.replica_group_id = group.replica_group_id
                try:
                    answer = await self.core.score_upstream(group.address, self.request_id, p.prompt_ids, top_logprobs)
                except (WorkerFailed, WorkerRejected) as exc:
                    failovers += 1
                    self._fail_over(self.reservation, exc, failovers)
                    continue
                self._finished = True
                self.replica_group_ids.append(self.replica_group_id)
                text = p.model.token_text
                return Scored(self.request_id, self.replica_group_id, list(p.prompt_ids),
                              [text(t) for t in p.prompt_ids], answer.logprobs,
                              [tuple(TokenAlternative(t, text(t), lp) for t, lp in at) for at in answer.top_logprobs],
                              answer.nll, answer.perplexity)
        except BaseException as exc:
            self._count_failure(exc)
            raise
        finally:
            self._done = True
            self._finish_reservation()

    async def _admit(self, prompt_tokens: int, max_tokens: int, prefix: PromptPrefix | None = None) -> Reservation:
        model = self.prepared.model
        reservation = self.core.admission.admit_now(model.name, prompt_tokens, max_tokens,
                                                    max_model_len=model.max_model_len, request_id=self.request_id,
                                                    prefix=prefix)
        if reservation is not None:
            return reservation
        return await self._wait_in_queue(prompt_tokens, max_tokens, prefix)

    async def _wait_in_queue(self, prompt_tokens: int, max_tokens: int, prefix: PromptPrefix | None) -> Reservation:
        """The blocking ``admit`` on a thread of its own; a reservation it gets after we stopped
        waiting (cancelled) is released at once."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Reservation] = loop.create_future()
        release = self.core.router.release
        model = self.prepared.model

        def settle(reservation: Reservation | None, exc: BaseException | None) -> None:
            self._queued = False
            if future.cancelled():
                release(reservation)
            elif exc is not None:
                future.set_exception(exc)
            else:
                future.set_result(reservation)

        def wait() -> None:
            reservation, error = None, None
            try:
                reservation = self.core.admission.admit(
                    model.name, prompt_tokens, max_tokens, max_model_len=model.max_model_len,
                    request_id=self.request_id, cancelled=self.cancelled, prefix=prefix)
            except BaseException as exc:  # noqa: BLE001 - handed to the loop, which raises it
                error = exc
            try:
                loop.call_soon_threadsafe(settle, reservation, error)
            except RuntimeError:  # the loop is closed: the process is stopping
                release(reservation)

        self._queued = True
        threading.Thread(target=wait, name=f"queued-{self.request_id}", daemon=True).start()
        try:
            return await future
        except asyncio.CancelledError:
            self.cancel()  # the thread sees it and leaves the queue
            raise

    def _open(self, prompt_ids: list[int], sampling: SamplingParams) -> None:
        reservation = self.reservation
        assert reservation is not None
        self.replica_group_id = reservation.group.replica_group_id
        # stop strings are matched here, over the tokens of every group (a continuation's group
        # sees the earlier ones only as prompt), so the worker gets none and makes no text
        self._upstream = self.core.open_upstream(reservation.group.address, self.request_id, prompt_ids,
                                                 replace(sampling, stop=()) if sampling.stop else sampling,
                                                 self.prepared.trace_context)
        if self.core.metrics is not None:
            self._running_on = self.replica_group_id
            self.core.metrics.request_started(self.replica_group_id)
        if self.cancelled.is_set():
            self._upstream.cancel()
            raise RequestCancelled(f"request {self.request_id} cancelled")

    def cancel(self) -> None:
        """Client cancel or disconnect: stop the worker's sequence (or leave the queue)."""
        if self.cancelled.is_set():
            return
        self.cancelled.set()
        if self._upstream is not None and not self._finished:
            self._upstream.cancel()
        if self._queued:
            self.core.admission.wake()

    def close(self) -> None:
        """However the request ended: stop the worker's sequence unless it finished, release the
        reservation. Idempotent; the relay calls it, and so does every front door."""
        if self._started and not self._finished and not self._done:
            # the consumer went away between events: the request ends as cancelled
            self._count_failure(RequestCancelled(f"request {self.request_id} cancelled"))
        self._done = True
        if self._upstream is not None and not self._finished:
            self._upstream.cancel()  # the worker must stop too
        self._finish_reservation()
        job, self._shadow_job = self._shadow_job, None
        if job is not None:  # the client's stream has ended: mirroring cannot delay it
            self.core.shadow.offer(job)

    def _finish_reservation(self) -> None:
        reservation, self.reservation = self.reservation, None
        if reservation is not None and not reservation.released:
            self.core.router.release(reservation)
        if self._running_on and self.core.metrics is not None:
            self.core.metrics.request_ended(self._running_on)
        self._running_on = ""

    def _count_failure(self, exc: BaseException) -> None:
        if self.core.metrics is None or self._failure_counted or isinstance(exc, GeneratorExit):
            return
        self._failure_counted = True
        if isinstance(exc, asyncio.CancelledError):  # the client went away
            exc = RequestCancelled(f"request {self.request_id} cancelled")
        self.core.metrics.request_failed(self.prepared.model.name, exc, replica_group=self.replica_group_id)

    def _timings(self, first_ns: int, last_ns: int) -> Timings:
        end_ns = time.monotonic_ns()
        return Timings(queue_ns=max(0, self.admitted_ns - self.arrival_ns),
                       time_to_first_token_ns=(first_ns - self.arrival_ns) if first_ns else 0,
                       decode_ns=(last_ns - first_ns) if first_ns else 0, total_ns=end_ns - self.arrival_ns)

    async def __aiter__(self) -> AsyncIterator[TokenOut | Finished]:
        """Start if not started, then the relay: TokenOut events, then one Finished."""
        await self.start()  # counts and cleans up its own failures
        try:
            p = self.prepared
            model = p.model
            detok = model.detokenizer(p.sampling.stop)
            push = detok.push if detok is not None else None
            generated: list[int] = []
            first_ns = last_ns = 0
            failovers = 0
            want_texts = p.token_texts
            token_text = model.token_text
            monotonic_ns = time.monotonic_ns
            shadow_logprobs = self._shadow_logprobs
            metrics = self.core.metrics
            token_ns: list[int] = []  # when each token came (the inter-token latencies)
            stamp = token_ns.append if metrics is not None else None
            while True:
                upstream, reservation = self._upstream, self.reservation
                assert upstream is not None and reservation is not None
                next_event = upstream.next
                continued_from = self._continued_from
                try:
                    while True:
                        event = await next_event()
                        if event.__class__ is UpstreamFinished:
                            if event.reason is FinishReason.CANCELLED and self.cancelled.is_set():
                                raise RequestCancelled(f"request {self.request_id} cancelled")
                            yield self._finish(event.reason, generated, first_ns, last_ns, detok, token_ns)
                            return
                        last_ns = monotonic_ns()
                        if stamp is not None:
                            stamp(last_ns)
                        if not first_ns:
                            first_ns = last_ns
                        index = len(generated)
                        if index == continued_from:  # the first token of this group's
                            self.replica_group_ids.append(self.replica_group_id)
                        token_id = event.token_id
                        generated.append(token_id)
                        if shadow_logprobs is not None:
                            shadow_logprobs.append(event.logprob)
                        reservation.generated = index + 1 - continued_from
                        text, stop_hit = push(token_id) if push is not None else ("", False)
                        if want_texts:
                            yield TokenOut(index, token_id, text, event.logprob,
                                           tuple([TokenAlternative(t, token_text(t), lp)
                                                  for t, lp in event.top_logprobs]), token_text(token_id))
                        elif event.top_logprobs:
                            yield TokenOut(index, token_id, text, event.logprob,
                                           tuple([TokenAlternative(t, "", lp) for t, lp in event.top_logprobs]))
                        else:
                            yield TokenOut(index, token_id, text, event.logprob)
                        if stop_hit:  # the router matches stop strings (the worker got none): end it there
                            upstream.cancel(stop=True)
                            yield self._finish(FinishReason.STOP_SEQUENCE, generated, first_ns, last_ns, detok,
                                               token_ns)
                            return
                except (WorkerFailed, WorkerRejected) as exc:
                    if self.cancelled.is_set():
                        raise RequestCancelled(f"request {self.request_id} cancelled") from None
                    remaining = p.sampling.max_tokens - len(generated)
                    if isinstance(exc, WorkerFull):  # refused before its first token: admitted again, no failover
                        self._refused(reservation, exc)
                    elif remaining <= 0:  # the request is complete: nothing to continue
                        self._fail_over(reservation, exc, failovers=0)  # marks the group, never raises
                        yield self._finish(FinishReason.LENGTH, generated, first_ns, last_ns, detok, token_ns)
                        return
                    else:
                        failovers += 1
                        self._fail_over(reservation, exc, failovers)
                    sampling = replace(p.sampling, max_tokens=remaining,
                                       first_step=p.sampling.first_step + len(generated))
                    await self._continue(p.prompt_ids + generated, sampling, continued_from=len(generated))
        except BaseException as exc:
            self._count_failure(exc)
            raise
        finally:
            self.close()

    def _finish(self, reason: FinishReason, generated: list[int], first_ns: int, last_ns: int,
                detok: Detokenizer | None, token_ns: list[int]) -> Finished:
        """The stream's last event: counted, and offered to the shadow mirror (a method, not a
        closure in ``__aiter__``, so the relay loop's locals stay fast locals)."""
        self._finished = True
        p = self.prepared
        finished = Finished(reason, len(p.prompt_ids), len(generated), self._timings(first_ns, last_ns),
                            detok.stopped_by if detok is not None else None, detok.text if detok else "")
        if self.core.metrics is not None:
            self.core.metrics.request_finished(p.model.name, finished, replica_group=self.replica_group_id,
                                               max_tokens=p.sampling.max_tokens, token_ns=token_ns)
        shadow_logprobs = self._shadow_logprobs
        if shadow_logprobs and not self._continued_from and reason in MIRRORED_REASONS:
            self._shadow_job = ShadowJob(
                self.request_id, p.model.name, self.replica_group_id, tuple(p.prompt_ids),
                tuple(generated), tuple(shadow_logprobs), p.sampling.temperature == 0)
        return finished

    def _refused(self, reservation: Reservation, exc: WorkerFull) -> None:
        """The group's worker found our KV claim over its budget (another router got there
        first): no headroom there until its next report; give up once the queue wait is over."""
        self.core.replicas.mark_full(reservation.group)
        self._finish_reservation()
        waited_s = (time.monotonic_ns() - self.arrival_ns) / 1e9
        if waited_s > self.core.admission.config.max_wait_s:
            raise ResourceExhausted(f"no replica group had KV headroom for request {self.request_id} within "
                                    f"{self.core.admission.config.max_wait_s:g} s (last: {exc})")

    def _fail_over(self, reservation: Reservation, exc: WorkerFailed | WorkerRejected, failovers: int) -> None:
        view = reservation.group
        if isinstance(exc, WorkerFailed):
            log.warning("request %s: %s; continuing elsewhere", self.request_id, exc)
            self.core.replicas.mark_failed(view, str(exc))
        else:
            with self.core.replicas.lock:
                view.draining = True  # the next Stats report confirms it
                view.refresh_status(time.monotonic())
        self._finish_reservation()
        if failovers > self.core.max_continuations:
            raise exc

    async def _continue(self, prompt_ids: list[int], sampling: SamplingParams, *, continued_from: int) -> None:
        self._upstream = None
        self.reservation = await self._admit(len(prompt_ids), sampling.max_tokens,
                                             PromptPrefix(prompt_ids, sampling.cache_salt))
        self._continued_from = continued_from
        self._open(prompt_ids, sampling)
