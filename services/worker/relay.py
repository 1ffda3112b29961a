"""One Relay stream's requests on the engine, their events sent one batch per engine step.

A router keeps one Relay stream per worker and multiplexes its requests on it (the shape of
SGLang's detokenizer manager): instead of one gRPC message per token per request, the worker
sends one message per engine step carrying that step's events of every request of the stream.

:class:`RelaySession` is the stream's domain half (no gRPC; ``server.py`` is the other): each
request gets an engine event sink that appends ``(relay_id, event)`` to the session's pending
list on the engine's loop thread; the engine calls the session's listener once a step's events
are all out, which hands the list to the stream's sender as one batch. Events are TokenEvent,
FinishEvent and ErrorEvent (the group failed mid-generation: its ``token_ids`` are the ids
produced so far) from the engine, and :class:`Rejected` for a request the engine refused (bad
field, too long, draining, group already failed): one request's failure is that request's event
only. A cancel frees the sequence's blocks at once and silences its events; closing the session
(the stream ended or broke) cancels every live request.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator, Mapping
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

from opentelemetry.trace import use_span

from services.common.errors import InvalidArgument, ShardlineError
from services.common.sampling import FinishReason, SamplingParams
from services.telemetry.tracing import start_server_span
from services.worker.engine.engine import LLMEngine, RequestHandle
from services.worker.engine.step import TokenEvent

SPAN_NAME = "shardline.worker/Relay"
_END = object()  # no more batches: the input ended and no request is live, or the session closed


class RelayProtocolError(InvalidArgument):
    """The client broke the Relay protocol (a relay_id reused while live, an empty command);
    the whole stream fails with it."""


@dataclass(frozen=True, slots=True)
class Rejected:
    """The engine refused the request before it started; nothing was produced."""

    error: ShardlineError


class _Relayed:
    """One relayed request: the engine's event sink for it (``put`` runs on the loop thread)."""

    __slots__ = ("session", "relay_id", "handle", "span", "cancelled")

    def __init__(self, session: RelaySession, relay_id: int, span: Any) -> None:
        self.session = session
        self.relay_id = relay_id
        self.handle: RequestHandle | None = None
        self.span = span
        self.cancelled = False

    def put(self, event: Any) -> None:
        if self.cancelled:
            return  # produced in a step that ran before the cancel reached the loop
        session = self.session
        session._pending.append((self.relay_id, event))
        if event.__class__ is not TokenEvent:
            session._forget(self.relay_id)


class RelaySession:
    """The requests of one Relay stream (see the module docstring). ``submit``/``reject``/
    ``cancel``/``end_input`` come from the stream's reader thread, ``batches()`` is consumed by
    its sender, ``close()`` may come from any thread (and more than once)."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._live: dict[int, _Relayed] = {}
        self._lock = threading.Lock()
        self._pending: list[tuple[int, Any]] = []  # the loop thread's, until the step's flush
        self._out: queue.SimpleQueue = queue.SimpleQueue()  # batches, then _END or an exception
        self._input_done = False
        self._closed = False
        engine.output_listeners.append(self._flush)

    @property
    def live(self) -> int:
        return len(self._live)

    def submit(self, relay_id: int, prompt_ids: list[int], params: SamplingParams, *, request_id: str = "",
               trace_context: Mapping[str, str] | None = None, reserve_kv: bool = False,
               texts: bool = False) -> None:
        """Start a request; a refusal by the engine becomes its :class:`Rejected` event. Raises
        RelayProtocolError if ``relay_id`` is live. ``texts``: the token events carry text (a
        Relay stream sends ids only, and the engine detokenizes its requests only for their stop
        strings)."""
        with self._lock:  # only this (the reader's) thread adds ids: check, then add below
            if self._closed:
                return
            self._check_new(relay_id)
        relayed = _Relayed(self, relay_id, start_server_span(SPAN_NAME, trace_context) if trace_context else None)
        with self._lock:
            if not self._closed:
                self._live[relay_id] = relayed  # before the engine can finish it
        if self._closed:
            self._end_span(relayed)
            return
        try:
            with use_span(relayed.span) if relayed.span is not None else nullcontext():
                # (the engine's step tracer binds the current span to the sequence)
                relayed.handle = self.engine.submit(prompt_ids, params, request_id=request_id, events=relayed,
                                                    reserve_kv=reserve_kv, texts=texts)
        except ShardlineError as exc:
            self._forget(relay_id)
            self._out.put([(relay_id, Rejected(exc))])
            return
        if relayed.cancelled:  # closed from another thread while the engine took it
            relayed.handle.cancel()

    def reject(self, relay_id: int, error: ShardlineError) -> None:
        """A request the stream's reader could not even parse: its one event is ``Rejected``."""
        with self._lock:
            self._check_new(relay_id)
        self._out.put([(relay_id, Rejected(error))])

    def cancel(self, relay_id: int, reason: FinishReason = FinishReason.CANCELLED) -> None:
        """Stop a live request and free its blocks; no event follows. Unknown ids are ignored.
        ``reason``: STOP_SEQUENCE when the client matched a stop string (the engine records it so)."""
        relayed = self._forget(relay_id)
        if relayed is not None:
            relayed.cancelled = True
            if relayed.handle is not None:
                relayed.handle.cancel(reason)

    def end_input(self) -> None:
        """The client half-closed: the batches end once the live requests have."""
        self._input_done = True
        if not self._live:
            self._out.put(_END)

    def fail(self, error: ShardlineError) -> None:
        """End the stream with ``error`` (a protocol violation), cancelling its requests."""
        self._out.put(error)
        self.close()

    def close(self) -> None:
        """The stream ended or broke: cancel every live request and end the batches."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            ids = list(self._live)
        try:
            self.engine.output_listeners.remove(self._flush)
        except ValueError:
            pass
        for relay_id in ids:
            self.cancel(relay_id)
        self._out.put(_END)

    def batches(self) -> Iterator[list[tuple[int, Any]]]:
        """Each engine step's events of this stream's requests, in order; batches the sender fell
        behind on come merged. Raises the error given to ``fail``."""
        out = self._out
        while True:
            item = out.get()
            while item.__class__ is list and not out.empty():
                following = out.get_nowait()
                if following.__class__ is not list:
                    yield item
                    item = following
                    break
                item.extend(following)
            if item is _END:
                return
            if isinstance(item, BaseException):
                raise item
            yield item

    # -- internals ---------------------------------------------------------------------------
    def _check_new(self, relay_id: int) -> None:
        if relay_id in self._live:
            raise RelayProtocolError(f"relay_id {relay_id} is already live on this stream")

    def _forget(self, relay_id: int) -> _Relayed | None:
        """Remove a request that ended (any thread); whoever removes it ends its span."""
        with self._lock:
            relayed = self._live.pop(relay_id, None)
        if relayed is not None:
            self._end_span(relayed)
        return relayed

    @staticmethod
    def _end_span(relayed: _Relayed) -> None:
        span, relayed.span = relayed.span, None
        if span is not None:
            span.end()

    def _flush(self) -> None:
        """Engine listener (loop thread): the step's events go out as one batch."""
        if self._pending:
            batch, self._pending = self._pending, []
            self._out.put(batch)
            if self._input_done and not self._live:
                self._out.put(_END)
