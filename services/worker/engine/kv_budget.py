"""The group's KV budget: how much KV the requests admitted here may claim, whoever sent them.

A request's claim is its router's estimate, ``(prompt + max_tokens) × kv_bytes_per_token`` per
GPU of the fullest stage: every token it may ever cache. ``admitted`` is the sum of the claims
of the requests the engine holds now (queued, running or preempted). A request submitted with
``reserve_kv`` is refused with :class:`KVBudgetFull` (RESOURCE_EXHAUSTED, before anything runs)
unless ``admitted`` plus its claim fits ``capacity``.

This is where admission is exact across routers. Each router picks a group from the worker's
last Stats report and its own reservations: a forecast, which two routers may both make on the
same headroom. The worker decides, one request at a time under one lock, so the sum of what it
admitted never passes its budget (``peak`` records the most it ever held, for tests and Stats).
A refused router tries another group or waits in its queue. Requests without ``reserve_kv`` (the
CLI, a bare ``Generate``) are counted but never refused: the scheduler queues or preempts them.
"""

from __future__ import annotations

import threading

from services.common.errors import KV_BUDGET_FULL, ResourceExhausted


class KVBudgetFull(ResourceExhausted):
    """The request's KV claim does not fit beside the requests this group admitted already."""


class KVBudget:
    """Claims of the engine's unfinished requests, by sequence id. Any thread."""

    def __init__(self, capacity_bytes: int, bytes_per_token: int) -> None:
        self.capacity = capacity_bytes
        self.bytes_per_token = bytes_per_token
        self.admitted = 0
        self.peak = 0
        self.refused = 0
        self._claims: dict[int, int] = {}
        self._lock = threading.Lock()

    def admit(self, seq_id: int, tokens: int, *, reserve: bool) -> None:
        """Record the claim of ``tokens`` (prompt + max_tokens) for ``seq_id``; with ``reserve``,
        raise KVBudgetFull instead when it does not fit."""
        claim = tokens * self.bytes_per_token
        with self._lock:
            if reserve and self.admitted + claim > self.capacity:
                self.refused += 1
                raise KVBudgetFull(
                    f"{KV_BUDGET_FULL}: a claim of {claim} bytes ({tokens} tokens) does not fit beside "
                    f"{self.admitted} of {self.capacity} bytes admitted here")
            self._claims[seq_id] = claim
            self.admitted += claim
            if self.admitted > self.peak:
                self.peak = self.admitted

    def release(self, seq_id: int) -> None:
        """The request ended (finished, cancelled, failed); unknown ids are ignored."""
        with self._lock:
            claim = self._claims.pop(seq_id, None)
            if claim is not None:
                self.admitted -= claim

    def clear(self) -> None:
        with self._lock:
            self._claims.clear()
            self.admitted = 0
