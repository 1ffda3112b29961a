"""Routing by KV headroom: pick a group for a request and hold a reservation until it ends.

A request's estimate on group g is ``(prompt_tokens + max_tokens) × kv_bytes_per_token(g)``,
per GPU of g's fullest stage, so groups with different plans (TP/PP/dtype) compare fairly. The
pick is the routable group with the lowest utilization among those whose headroom covers the
estimate, where both count our reservations:

    committed(g)   = kv_bytes_used(g) + Σ_r∈g (estimate(r) − materialized(r))
    utilization(g) = committed(g) / kv_bytes_capacity(g)
    headroom(g)    = kv_bytes_capacity(g) − committed(g)

``materialized(r)`` is the part of r that the worker's last Stats report already counts in
``kv_bytes_used``: 0 until r's first token (its prefill done), then (prompt + tokens generated)
× kv_bytes_per_token as of that report. So a request is counted once — by the estimate while
the worker has not reported it, by the worker as it fills its blocks — and the estimate
guards the growth still to come. Ties go to the lower replica_group_id (deterministic).

Reserve at pick, release on finish, error or cancel (``Router.release``, idempotent).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from dataclasses import dataclass

from services.router.replicas import ReplicaGroupView, ReplicaSet


def kv_estimate(prompt_tokens: int, max_tokens: int, kv_bytes_per_token: int) -> int:
    """KV bytes a request may need on a group: every prompt and completion token cached."""
    return (prompt_tokens + max_tokens) * kv_bytes_per_token


@dataclass(eq=False)
class Reservation:
    """An admitted request's claim on one group's KV cache."""

    reservation_id: int
    request_id: str
    group: ReplicaGroupView
    prompt_tokens: int
    max_tokens: int
    kv_bytes: int
    generated: int = 0  # tokens streamed so far (written by the request's thread)
    materialized_bytes: int = 0  # part of kv_bytes inside the group's last kv_bytes_used
    released: bool = False

    def in_cache_bytes(self) -> int:
        """What the worker holds for this request now, as far as the router can tell."""
        if self.generated == 0:
            return 0  # maybe still queued in the worker: count the whole estimate
        tokens = self.prompt_tokens + self.generated
        return min(self.kv_bytes, tokens * self.group.kv_bytes_per_token)


def fits_group(view: ReplicaGroupView, prompt_tokens: int, max_tokens: int) -> bool:
    """True when the group could ever take the request (its whole budget, its context)."""
    return (view.kv_bytes_per_token > 0 and prompt_tokens + max_tokens <= view.max_model_len
            and kv_estimate(prompt_tokens, max_tokens, view.kv_bytes_per_token) <= view.kv_bytes_capacity)


def pick(views: Iterable[ReplicaGroupView], prompt_tokens: int, max_tokens: int) -> ReplicaGroupView | None:
    """The routable group with the lowest utilization whose headroom covers the estimate, one
    that is not running a shadow Score first (a Score holds its engine between two steps)."""
    tokens = prompt_tokens + max_tokens
    best: ReplicaGroupView | None = None
    best_key: tuple[bool, float, str] | None = None
    for view in views:
        capacity = view.kv_bytes_capacity
        need = tokens * view.kv_bytes_per_token
        if not view.routable or not view.kv_bytes_per_token or tokens > view.max_model_len or need > capacity:
            continue
        committed = view.kv_bytes_used + view.kv_bytes_reserved - view.kv_bytes_materialized
        if capacity - committed < need:
            continue
        key = (view.shadow_scores > 0, committed / capacity, view.replica_group_id)
        if best_key is None or key < best_key:
            best, best_key = view, key
    return best


class Router:
    """Reservations over a ReplicaSet; every method takes the set's lock itself unless its name
    ends in ``_locked``."""

    def __init__(self, replicas: ReplicaSet) -> None:
        self.replicas = replicas
        self._ids = itertools.count(1)

    def try_reserve_locked(self, model: str, prompt_tokens: int, max_tokens: int, *,
                           request_id: str = "") -> Reservation | None:
        view = pick(self.replicas.for_model(model), prompt_tokens, max_tokens)
        if view is None:
            return None
        reservation = Reservation(next(self._ids), request_id, view, prompt_tokens, max_tokens,
                                  kv_estimate(prompt_tokens, max_tokens, view.kv_bytes_per_token))
        view.add_reservation(reservation)
        return reservation

    def try_reserve(self, model: str, prompt_tokens: int, max_tokens: int, *,
                    request_id: str = "") -> Reservation | None:
        with self.replicas.lock:
            return self.try_reserve_locked(model, prompt_tokens, max_tokens, request_id=request_id)

    def release(self, reservation: Reservation | None) -> None:
        """Give the reservation back (no-op if already released) and wake queued requests."""
        if reservation is None:
            return
        with self.replicas.lock:
            if reservation.released:
                return
            reservation.released = True
            reservation.group.remove_reservation(reservation)
            self.replicas.changed.notify_all()
