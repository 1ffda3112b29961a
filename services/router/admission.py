"""Admission: reject what can never run, queue what cannot run yet, reserve what can run now.

In order, for a request of P prompt tokens and C = max_tokens:

1. P + C beyond the model's context length → INVALID_ARGUMENT, vLLM's message with the numbers.
2. No group serving the model has reported → UNAVAILABLE.
3. P + C fits no group's whole KV budget (nor its context) → INVALID_ARGUMENT with the numbers.
4. No routable group that could hold it (all unhealthy, draining, expired) → UNAVAILABLE.
5. A group has headroom now and nobody is queued ahead → reserved at once.
6. Otherwise the request waits in the model's bounded FIFO queue: RESOURCE_EXHAUSTED when the
   queue is full on arrival, or when ``max_wait_s`` passes before the request reaches the
   head and a group has headroom. Only the head of the queue is placed (no overtaking), and
   checks 3-4 run again while it waits, so a queued request whose groups all fail leaves
   with UNAVAILABLE instead of timing out.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from services.common.errors import InvalidArgument, ResourceExhausted, ShardlineError, Unavailable
from services.router.replicas import ReplicaGroupView, ReplicaSet, Reservation
from services.router.routing import PromptPrefix, Router, fits_group, kv_estimate

DEFAULT_MAX_QUEUE = 64
DEFAULT_MAX_WAIT_S = 30.0
_WAKE_S = 0.1  # waiters also wake on this period, so a cancel is seen without a notify


# HTTP 499 is nginx's "client closed request": nobody is left to read the answer
class RequestCancelled(ShardlineError, http_status=499, openai_type="request_cancelled"):
    """The client went away (cancelled or disconnected) before the request finished."""


@dataclass(frozen=True)
class QueueConfig:
    """The admission queue: at most ``max_size`` waiting requests per model, each for at most
    ``max_wait_s`` seconds. ``max_size`` 0 disables queueing (no headroom → RESOURCE_EXHAUSTED)."""

    max_size: int = DEFAULT_MAX_QUEUE
    max_wait_s: float = DEFAULT_MAX_WAIT_S

    def __post_init__(self) -> None:
        if self.max_size < 0:
            raise InvalidArgument(f"queue size must be >= 0, got {self.max_size}")
        if not self.max_wait_s > 0:
            raise InvalidArgument(f"queue wait must be > 0 seconds, got {self.max_wait_s}")


def context_error(max_model_len: int, prompt_tokens: int, max_tokens: int) -> InvalidArgument | None:
    """vLLM's message when prompt + completion exceed the context length, else None."""
    total = prompt_tokens + max_tokens
    if total <= max_model_len:
        return None
    return InvalidArgument(
        f"This model's maximum context length is {max_model_len} tokens. However, you requested "
        f"{total} tokens ({prompt_tokens} in the messages, {max_tokens} in the completion). "
        f"Please reduce the length of the messages or completion.")


def check_placeable(model: str, views: list[ReplicaGroupView], prompt_tokens: int, max_tokens: int) -> None:
    """Checks 2-4 of the module docstring (the caller holds the replica set's lock)."""
    fits_any = False
    for v in views:  # the common case, in one pass: a routable group that could hold it
        if fits_group(v, prompt_tokens, max_tokens):
            if v.routable:
                return
            fits_any = True
    reported = [v for v in views if v.kv_bytes_per_token > 0]
    if not reported:
        raise Unavailable(f"no replica group serving model {model!r} has reported yet; retry later")
    if not fits_any:
        best = max(reported, key=lambda v: v.token_limit)
        bpt = best.kv_bytes_per_token
        total = prompt_tokens + max_tokens
        raise InvalidArgument(
            f"This request needs KV cache for {total} tokens ({prompt_tokens} in the messages, "
            f"{max_tokens} in the completion): {kv_estimate(prompt_tokens, max_tokens, bpt)} bytes at "
            f"{bpt} bytes per token, but the largest replica group ({best.replica_group_id}) holds at most "
            f"{best.token_limit} tokens ({best.kv_bytes_capacity} bytes of KV cache, max_model_len "
            f"{best.max_model_len}). Please reduce the length of the messages or completion.")
    # something could hold it, but no group that could is routable now
    states = ", ".join(f"{v.replica_group_id}: {v.status.value}"
                       + (f" ({v.status_reason})" if v.status_reason else "") for v in reported)
    raise Unavailable(f"no healthy replica group can serve model {model!r} now ({states})")


class AdmissionQueue:
    """Per-model FIFO of requests waiting for KV headroom, on the replica set's condition."""

    def __init__(self, replicas: ReplicaSet, router: Router, config: QueueConfig | None = None,
                 *, clock: Callable[[], float] = time.monotonic) -> None:
        self.replicas = replicas
        self.router = router
        self.config = config or QueueConfig()
        self.clock = clock
        self._waiting: dict[str, collections.deque[object]] = collections.defaultdict(collections.deque)

    def depth(self, model: str | None = None) -> int:
        """Requests waiting (for one model, or all)."""
        if model is not None:
            return len(self._waiting.get(model, ()))
        return sum(len(q) for q in self._waiting.values())

    def _queue_full(self, model: str, waiting: int) -> ResourceExhausted:
        return ResourceExhausted(
            f"the admission queue for model {model!r} is full ({waiting} requests waiting for KV "
            f"headroom, limit {self.config.max_size}); retry later")

    def admit_now(self, model: str, prompt_tokens: int, max_tokens: int, *, max_model_len: int,
                  request_id: str = "", prefix: PromptPrefix | None = None) -> Reservation | None:
        """Checks 1-5 and the queue's bound without waiting (for an event loop, which must not
        block): a reservation, one of the errors, or None when the request has to wait in the
        queue, which :meth:`admit` (on a thread of its own) then does."""
        error = context_error(max_model_len, prompt_tokens, max_tokens)
        if error is not None:
            raise error
        with self.replicas.lock:
            check_placeable(model, self.replicas.for_model(model), prompt_tokens, max_tokens)
            waiting = len(self._waiting.get(model, ()))
            if not waiting:
                reservation = self.router.try_reserve_locked(model, prompt_tokens, max_tokens, request_id=request_id,
                                                              prefix=prefix)
                if reservation is not None:
                    return reservation
            if waiting >= self.config.max_size:
                raise self._queue_full(model, waiting)
        return None

    def admit(self, model: str, prompt_tokens: int, max_tokens: int, *, max_model_len: int,
              request_id: str = "", cancelled: threading.Event | None = None,
              prefix: PromptPrefix | None = None) -> Reservation:
        """A reservation on some group, after waiting in the queue if needed (module docstring)."""
        error = context_error(max_model_len, prompt_tokens, max_tokens)
        if error is not None:
            raise error
        cond = self.replicas.changed
        with cond:
            check_placeable(model, self.replicas.for_model(model), prompt_tokens, max_tokens)
            queue = self._waiting[model]
            if not queue:
                reservation = self.router.try_reserve_locked(model, prompt_tokens, max_tokens, request_id=request_id,
                                                              prefix=prefix)
                if reservation is not None:
                    return reservation
            if len(queue) >= self.config.max_size:
                raise self._queue_full(model, len(queue))
            ticket = object()
            queue.append(ticket)
            deadline = self.clock() + self.config.max_wait_s
            try:
                while True:
                    if cancelled is not None and cancelled.is_set():
                        raise RequestCancelled(f"request {request_id} cancelled while queued")
                    if queue[0] is ticket:
                        check_placeable(model, self.replicas.for_model(model), prompt_tokens, max_tokens)
                        reservation = self.router.try_reserve_locked(model, prompt_tokens, max_tokens,
                                                                     request_id=request_id, prefix=prefix)
                        if reservation is not None:
                            return reservation
                    remaining = deadline - self.clock()
                    if remaining <= 0:
                        raise ResourceExhausted(
                            f"no replica group had KV headroom for this request ({prompt_tokens} prompt + "
                            f"{max_tokens} completion tokens) within the queue deadline of "
                            f"{self.config.max_wait_s:g} s; retry later")
                    cond.wait(min(remaining, _WAKE_S))
            finally:
                queue.remove(ticket)
                cond.notify_all()  # the next in line may be placeable now

    def wake(self) -> None:
        """Wake waiters (e.g. after a cancel) so they re-check at once."""
        with self.replicas.changed:
            self.replicas.changed.notify_all()
