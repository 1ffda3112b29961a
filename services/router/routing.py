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

**Several routers.** The pick is a forecast; the worker decides. Every request goes out with
``reserve_kv``: the worker admits it only if its estimate fits beside the estimates of every
request it holds, from any router (``services/worker/engine/kv_budget.py``), so two routers can
never spend the same headroom. Each Stats report says what the worker holds (``admitted``); what
is not ours of it counts too, ``committed(g) = max(the sum above, elsewhere(g) + Σ_r∈g
estimate(r))`` with ``elsewhere(g) = admitted(g) − Σ_r∈g estimate(r)`` at the report. A refusal
(``WorkerFull``) sets ``elsewhere(g)`` to the capacity until the next report, and the request
goes back to admission: another group, or the queue.

**Prefix affinity.** Each group's poller mirrors the names of the blocks its prefix cache holds
(``ReplicaGroupView.prefix_blocks``, and ``ReplicaSet.prefix_index``: which groups hold a name).
Among the groups that fit by the rule above, the one that would reuse the most of the prompt's
leading blocks (``PromptPrefix.deepest_holders``) gets the request, the least busy first among
equals, unless it is busier than the least busy fitting group by more than :func:`load_slack`:
then the headroom rule picks, the hot prefix gets a second home, and from then on its requests
go to whichever home is less busy. Busy is this router's requests on the group plus the group's
own queue (``waiting``). So the fit rule always holds, a prefix sticks where it is cached, and a
hot one spreads instead of starving the rest.
"""

from __future__ import annotations

import itertools
from collections.abc import Container, Iterable, Sequence
from dataclasses import dataclass, field

from services.common.prefix_blocks import BlockNames, reusable_blocks
from services.router.replicas import PrefixIndex, ReplicaGroupView, ReplicaSet, Reservation


def kv_estimate(prompt_tokens: int, max_tokens: int, kv_bytes_per_token: int) -> int:
    """KV bytes a request may need on a group: every prompt and completion token cached."""
    return (prompt_tokens + max_tokens) * kv_bytes_per_token


def fits_group(view: ReplicaGroupView, prompt_tokens: int, max_tokens: int) -> bool:
    """True when the group could ever take the request (its whole budget, its context)."""
    return (view.kv_bytes_per_token > 0 and prompt_tokens + max_tokens <= view.max_model_len
            and kv_estimate(prompt_tokens, max_tokens, view.kv_bytes_per_token) <= view.kv_bytes_capacity)


@dataclass(eq=False)
class PromptPrefix:
    """A prompt's token ids and cache salt, its reusable blocks named on demand (only as deep as
    some group holds them: a prompt no group caches costs one name), once per block size."""

    token_ids: Sequence[int]
    salt: str | None = None
    _names: dict[int, BlockNames] = field(default_factory=dict, repr=False)

    def names(self, size: int) -> BlockNames:
        names = self._names.get(size)
        if names is None:
            names = self._names[size] = BlockNames(self.token_ids, size, self.salt,
                                                   count=reusable_blocks(len(self.token_ids), size))
        return names

    def deepest_holders(self, index: PrefixIndex, size: int,
                        among: Container[ReplicaGroupView]) -> tuple[int, set[ReplicaGroupView]]:
        """The prompt tokens reusable on the groups of ``among`` that hold the longest run of its
        blocks (of ``size`` tokens), and those groups; (0, empty) when none holds the first."""
        chain = self.names(size)
        names = chain.extend(1)
        if not names:
            return 0, set()
        holders = index.holders
        alive = {view for view in holders.get(names[0], _NONE) if view in among}
        depth, deepest = 0, alive
        while alive:
            depth, deepest = depth + 1, alive
            if depth >= chain.count:
                break
            if depth >= len(names):
                names = chain.extend(2 * depth)
            alive = alive & holders.get(names[depth], _NONE)
        return depth * size, deepest


_NONE: frozenset = frozenset()


def load_slack(least: int) -> int:
    """How much busier than the least busy fitting group a group holding the prefix may be (busy:
    this router's requests on a group plus the group's own queue)."""
    return 2 + least // 2


def pick(views: Iterable[ReplicaGroupView], prompt_tokens: int, max_tokens: int,
         prefix: PromptPrefix | None = None, index: PrefixIndex | None = None) -> ReplicaGroupView | None:
    """The routable group with the lowest utilization whose headroom covers the estimate, one
    that is not running a shadow Score first (a Score holds its engine between two steps); with
    ``prefix`` and the groups' ``index``, the fitting group that caches most of it unless too
    busy (module docstring). One pass over the groups, a few field reads each (it runs for
    every request, over every group); the prefix is matched on the index, a set intersection
    per block."""
    tokens = prompt_tokens + max_tokens
    affinity = prefix is not None and index is not None and bool(index.holders)
    best: ReplicaGroupView | None = None
    best_key: tuple[bool, float, str] = (True, 0.0, "")
    fit: list[ReplicaGroupView] = []  # with affinity: every fitting group
    least = -1  # ... and the least busy one's load
    for view in views:
        capacity = view.kv_bytes_capacity
        need = tokens * view.kv_bytes_per_token
        if not view.routable or not view.kv_bytes_per_token or tokens > view.max_model_len or need > capacity:
            continue
        committed = view.committed_bytes
        if capacity - committed < need:
            continue
        key = (view.shadow_scores > 0, committed / capacity, view.replica_group_id)
        if best is None or key < best_key:
            best, best_key = view, key
        if affinity:
            fit.append(view)
            busy = len(view.reservations) + view.waiting
            if least < 0 or busy < least:
                least = busy
    if not affinity or len(fit) < 2:
        return best
    among = set(fit)
    reusable, holders = 0, set()
    for size in {view.block_size for view in fit if view.block_size > 0}:
        tokens_here, here = prefix.deepest_holders(index, size, among)
        if tokens_here > reusable:
            reusable, holders = tokens_here, here
    if not holders:
        return best
    view = min(holders, key=_busy_then_headroom)
    return view if len(view.reservations) + view.waiting <= least + load_slack(least) else best


def _busy_then_headroom(view: ReplicaGroupView) -> tuple[int, bool, float, str]:
    return len(view.reservations) + view.waiting, view.shadow_scores > 0, view.utilization, view.replica_group_id


class Router:
    """Reservations over a ReplicaSet; every method takes the set's lock itself unless its name
    ends in ``_locked``."""

    def __init__(self, replicas: ReplicaSet, *, prefix_affinity: bool = True) -> None:
        self.replicas = replicas
        self.prefix_affinity = prefix_affinity  # False: the headroom rule alone
        self._ids = itertools.count(1)

    def try_reserve_locked(self, model: str, prompt_tokens: int, max_tokens: int, *,
                           request_id: str = "", prefix: PromptPrefix | None = None) -> Reservation | None:
        view = pick(self.replicas.for_model(model), prompt_tokens, max_tokens,
                    prefix if self.prefix_affinity else None, self.replicas.prefix_index)
        if view is None:
            return None
        reservation = Reservation(next(self._ids), request_id, view, prompt_tokens, max_tokens,
                                  kv_estimate(prompt_tokens, max_tokens, view.kv_bytes_per_token))
        view.add_reservation(reservation)
        return reservation

    def try_reserve(self, model: str, prompt_tokens: int, max_tokens: int, *,
                    request_id: str = "", prefix: PromptPrefix | None = None) -> Reservation | None:
        with self.replicas.lock:
            return self.try_reserve_locked(model, prompt_tokens, max_tokens, request_id=request_id, prefix=prefix)

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
