"""The router's request path: prepare (tokenize, validate), admit, relay the worker's stream.

:class:`RouterCore` is what both front doors call (gRPC ``server.py`` and the OpenAI HTTP
app). A :class:`Generation` is one request: ``start()`` admits it (possibly after queueing)
and opens the stream on the chosen group; iterating relays tokens with the router's own
incremental detokenization; ``cancel()`` (any thread: client cancel or disconnect) cancels
the upstream call, which frees the worker's blocks, and the reservation is released whatever
way the stream ends.

If the group fails mid-stream (the worker ends the call with UNAVAILABLE), the group is marked
failed and the request continues on another group: prompt + the tokens already streamed
become the new prompt, ``max_tokens`` shrinks by as many, and the client sees one unbroken
stream (``replica_group_id`` changes on the messages that follow).
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace

from services.common.errors import InvalidArgument, Unavailable
from services.router.admission import AdmissionQueue, RequestCancelled
from services.router.catalog import ModelCatalog, ServedModel
from services.router.metrics import RouterMetrics
from services.router.replicas import ReplicaGroupView, ReplicaSet
from services.router.routing import Reservation, Router
from services.router.types import (
    Finished,
    FinishReason,
    GenerationRequest,
    SamplingSpec,
    Timings,
    TokenAlternative,
    TokenOut,
)
from services.router.worker_client import UpstreamFinished, UpstreamStream, WorkerFailed, WorkerRejected
from services.worker.engine.detokenizer import IncrementalDetokenizer

log = logging.getLogger(__name__)

DEFAULT_MAX_CONTINUATIONS = 2


# (address, request_id, prompt ids, sampling) -> an open Generate stream on that worker
OpenUpstream = Callable[[str, str, list[int], SamplingSpec], UpstreamStream]


@dataclass(frozen=True)
class Prepared:
    """A validated request: its model, prompt ids and sampling."""

    model: ServedModel
    prompt_ids: list[int]
    sampling: SamplingSpec
    request_id: str
    token_texts: bool = False


class RouterCore:
    def __init__(self, catalog: ModelCatalog, replicas: ReplicaSet, router: Router, admission: AdmissionQueue,
                 open_upstream: OpenUpstream, *,
                 metrics: RouterMetrics | None = None,
                 max_continuations: int = DEFAULT_MAX_CONTINUATIONS) -> None:
        self.catalog = catalog
        self.replicas = replicas
        self.router = router
        self.admission = admission
        self.open_upstream = open_upstream
        self.metrics = metrics
        self.max_continuations = max_continuations

    def prepare(self, request: GenerationRequest, *, token_texts: bool = False) -> Prepared:
        """Validate and tokenize; raises NotFound / InvalidArgument (nothing is reserved yet)."""
        model = self.catalog.get(request.model)
        sampling = request.sampling.validate()
        if request.prompt_ids is not None:
            ids = list(request.prompt_ids)
            if not ids:
                raise InvalidArgument("prompt must not be empty: token_ids has no ids")
            bad = [t for t in ids if not 0 <= t < model.vocab_size]
            if model.vocab_size and bad:
                raise InvalidArgument(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {model.vocab_size})")
        elif request.prompt_text:
            ids = model.encode(request.prompt_text, add_special_tokens=request.add_special_tokens)
            if not ids:
                raise InvalidArgument("prompt must not be empty: the text has no tokens")
        else:
            raise InvalidArgument("prompt must not be empty: set text or token_ids")
        request_id = request.request_id or f"rtr-{uuid.uuid4().hex[:16]}"
        return Prepared(model, ids, sampling, request_id, token_texts or sampling.logprobs > 0)

    def generate(self, request: GenerationRequest, *, token_texts: bool = False) -> Generation:
        return Generation(self, self.prepare(request, token_texts=token_texts))

    def groups(self, model: str = "") -> list[ReplicaGroupView]:
        with self.replicas.lock:
            views = [v for v in self.replicas.views() if not model or v.model == model]
            return sorted(views, key=lambda v: (v.replica_group_id, v.address))


class Generation:
    """One request through the router (see the module docstring)."""

    def __init__(self, core: RouterCore, prepared: Prepared) -> None:
        self.core = core
        self.prepared = prepared
        self.request_id = prepared.request_id
        self.cancelled = threading.Event()
        self.reservation: Reservation | None = None
        self.replica_group_id = ""
        self.arrival_ns = time.monotonic_ns()
        self.admitted_ns = 0
        self._lock = threading.Lock()
        self._upstream: UpstreamStream | None = None
        self._done = False  # the stream has ended, whatever the way
        self._finished = False  # a final event was produced (the worker needs no cancel)
        self._continued_from = 0  # tokens generated before the current upstream call
        self._running_on = ""  # group counted in the running-requests gauge

    @property
    def prompt_tokens(self) -> int:
        return len(self.prepared.prompt_ids)

    def start(self) -> None:
        """Admit (may wait in the queue) and open the stream; raises the admission errors."""
        if self.reservation is not None:
            return
        p = self.prepared
        metrics = self.core.metrics
        try:
            self.reservation = self.core.admission.admit(
                p.model.name, len(p.prompt_ids), p.sampling.max_tokens, max_model_len=p.model.max_model_len,
                request_id=self.request_id, cancelled=self.cancelled)
            self.admitted_ns = time.monotonic_ns()
            self._open(p.prompt_ids, p.sampling)
        except Exception as exc:
            self._finish_reservation()
            if metrics is not None:
                metrics.request_failed(p.model.name, exc)
            raise

    def _open(self, prompt_ids: list[int], sampling: SamplingSpec) -> None:
        reservation = self.reservation
        assert reservation is not None
        self.replica_group_id = reservation.group.replica_group_id
        upstream = self.core.open_upstream(reservation.group.address, self.request_id, prompt_ids, sampling)
        with self._lock:
            self._upstream = upstream
            cancelled = self.cancelled.is_set()
        if self.core.metrics is not None:
            self._running_on = self.replica_group_id
            self.core.metrics.request_started(self.replica_group_id)
        if cancelled:
            upstream.cancel()
            raise RequestCancelled(f"request {self.request_id} cancelled")

    def cancel(self) -> None:
        """Client cancel or disconnect: stop the worker's sequence and free the reservation."""
        if self.cancelled.is_set():
            return
        self.cancelled.set()
        with self._lock:
            upstream = self._upstream
        if upstream is not None:
            upstream.cancel()
        if not self._done:
            self.core.admission.wake()

    def _finish_reservation(self) -> None:
        reservation, self.reservation = self.reservation, None
        if reservation is not None and not reservation.released:
            self.core.router.release(reservation)
        if self._running_on and self.core.metrics is not None:
            self.core.metrics.request_ended(self._running_on)
        self._running_on = ""

    def __iter__(self) -> Iterator[TokenOut | Finished]:
        self.start()
        try:
            yield from self._relay()
        except Exception as exc:
            if self.core.metrics is not None:
                self.core.metrics.request_failed(self.prepared.model.name, exc)
            raise
        finally:
            self._done = True
            with self._lock:
                upstream = self._upstream
            if upstream is not None and not self._finished:
                upstream.cancel()  # the consumer went away: the worker must stop too
            self._finish_reservation()

    def _relay(self) -> Iterator[TokenOut | Finished]:
        p = self.prepared
        model = p.model
        detok = IncrementalDetokenizer(model.tokenizer, p.sampling.stop) if model.tokenizer is not None else None
        generated: list[int] = []
        first_ns = last_ns = 0
        stop_hit = False
        failovers = 0
        want_texts = p.token_texts
        while True:
            upstream = self._upstream
            assert upstream is not None and self.reservation is not None
            reservation = self.reservation
            try:
                for event in upstream:
                    if isinstance(event, UpstreamFinished):
                        reason = FinishReason.STOP_SEQUENCE if stop_hit else event.reason
                        if reason is FinishReason.CANCELLED and self.cancelled.is_set():
                            raise RequestCancelled(f"request {self.request_id} cancelled")
                        self._finished = True
                        end_ns = time.monotonic_ns()
                        timings = Timings(
                            queue_ns=max(0, self.admitted_ns - self.arrival_ns),
                            time_to_first_token_ns=(first_ns - self.arrival_ns) if first_ns else 0,
                            decode_ns=(last_ns - first_ns) if first_ns else 0,
                            total_ns=end_ns - self.arrival_ns)
                        finished = Finished(reason, len(p.prompt_ids), len(generated), timings,
                                            event.stop_sequence, detok.text if detok else "")
                        if self.core.metrics is not None:
                            self.core.metrics.request_finished(model.name, finished)
                        yield finished
                        return
                    if stop_hit:
                        # only after a continuation: the new worker did not see the text before
                        # its prompt, so the router's detokenizer found the stop string first
                        upstream.cancel()
                        self._finished = True
                        yield Finished(FinishReason.STOP_SEQUENCE, len(p.prompt_ids), len(generated),
                                       text=detok.text if detok else "")
                        return
                    last_ns = time.monotonic_ns()
                    if not first_ns:
                        first_ns = last_ns
                    index = len(generated)
                    generated.append(event.token_id)
                    reservation.generated = len(generated) - self._continued_from
                    text, stop_hit = detok.push(event.token_id) if detok is not None else ("", False)
                    alternatives = tuple(TokenAlternative(t, model.token_text(t) if want_texts else "", lp)
                                         for t, lp in event.top_logprobs)
                    yield TokenOut(index, event.token_id, text, event.logprob, alternatives,
                                   model.token_text(event.token_id) if want_texts else "")
                raise Unavailable(f"worker {upstream.address} ended the stream without a final message")
            except (WorkerFailed, WorkerRejected) as exc:
                if self.cancelled.is_set():
                    raise RequestCancelled(f"request {self.request_id} cancelled") from None
                failovers += 1
                remaining = p.sampling.max_tokens - len(generated)
                self._fail_over(reservation, exc, failovers)
                if remaining <= 0:
                    self._finished = True
                    yield Finished(FinishReason.LENGTH, len(p.prompt_ids), len(generated),
                                   text=detok.text if detok else "")
                    return
                self._continue(p.prompt_ids + generated, replace(p.sampling, max_tokens=remaining),
                               continued_from=len(generated))

    def _fail_over(self, reservation: Reservation, exc: Unavailable, failovers: int) -> None:
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

    def _continue(self, prompt_ids: list[int], sampling: SamplingSpec, *, continued_from: int) -> None:
        p = self.prepared
        self.reservation = self.core.admission.admit(
            p.model.name, len(prompt_ids), sampling.max_tokens, max_model_len=p.model.max_model_len,
            request_id=self.request_id, cancelled=self.cancelled)
        self._continued_from = continued_from
        self._open(prompt_ids, sampling)
