"""Admission: rejections with their numbers, the bounded FIFO queue, its deadline (exact)."""

from __future__ import annotations

import threading
import time

import pytest

from services.common.errors import InvalidArgument, ResourceExhausted, Unavailable
from services.common.group_status import GroupStatus
from services.router.admission import AdmissionQueue, QueueConfig, RequestCancelled, context_error
from services.router.replicas import ReplicaGroupView
from services.router.routing import Router
from tests.router.test_routing import BPT, replica_set, view


def queue_over(*views: ReplicaGroupView, max_size: int = 2, max_wait_s: float = 5.0) -> AdmissionQueue:
    replicas = replica_set(*views)
    return AdmissionQueue(replicas, Router(replicas), QueueConfig(max_size=max_size, max_wait_s=max_wait_s))


def admit(q: AdmissionQueue, p: int, m: int, **kw):
    return q.admit("m", p, m, max_model_len=2048, **kw)


def test_beyond_the_context_is_rejected_with_vllms_numbers():
    q = queue_over(view("a"))
    with pytest.raises(InvalidArgument) as caught:
        admit(q, 2000, 100)
    assert str(caught.value) == (
        "This model's maximum context length is 2048 tokens. However, you requested 2100 tokens "
        "(2000 in the messages, 100 in the completion). Please reduce the length of the messages or completion.")
    assert context_error(2048, 2000, 48) is None


def test_beyond_every_groups_kv_budget_is_rejected_with_the_numbers():
    q = queue_over(view("a", capacity_tokens=640, max_model_len=641), view("b", capacity_tokens=320))
    with pytest.raises(InvalidArgument) as caught:
        admit(q, 700, 16)
    assert str(caught.value) == (
        f"This request needs KV cache for 716 tokens (700 in the messages, 16 in the completion): "
        f"{716 * BPT} bytes at {BPT} bytes per token, but the largest replica group (a) holds at most 640 tokens "
        f"({640 * BPT} bytes of KV cache, max_model_len 641). Please reduce the length of the messages or "
        f"completion.")


def test_no_reported_or_no_healthy_group_is_unavailable():
    with pytest.raises(Unavailable, match="no replica group serving model 'm' has reported yet"):
        admit(queue_over(ReplicaGroupView(address="x:1", model="m")), 1, 1)
    with pytest.raises(Unavailable, match="no replica group serving model 'm' has reported yet"):
        admit(queue_over(view("a", model="other")), 1, 1)
    sick = view("a", status=GroupStatus.UNHEALTHY)
    sick.status_reason = "marked unhealthy in the health store"
    q = queue_over(sick, view("b", status=GroupStatus.DRAINING))
    with pytest.raises(Unavailable) as caught:
        admit(q, 1, 1)
    assert str(caught.value) == ("no healthy replica group can serve model 'm' now (a: unhealthy (marked unhealthy "
                                 "in the health store), b: draining)")
    # healthy but too small for this request, while the big one is down: unavailable, not invalid
    big = view("big", capacity_tokens=2000, status=GroupStatus.UNHEALTHY)
    with pytest.raises(Unavailable):
        admit(queue_over(big, view("small", capacity_tokens=100)), 500, 500)


def test_a_request_with_headroom_is_reserved_at_once():
    q = queue_over(view("a", used_tokens=600), view("b", used_tokens=10))
    r = admit(q, 20, 12, request_id="r1")
    assert (r.group.replica_group_id, r.kv_bytes, r.request_id) == ("b", 32 * BPT, "r1")
    assert q.depth() == 0


def test_queue_is_fifo_bounded_and_released_reservations_wake_it():
    a = view("a")
    q = queue_over(a, max_size=2, max_wait_s=10.0)
    hog = admit(q, 320, 300)  # 620 of 640 tokens
    placed: list[str] = []

    def waiter(name: str, tokens: int) -> None:
        placed.append((name, admit(q, tokens // 2, tokens - tokens // 2, request_id=name).request_id))

    first = threading.Thread(target=waiter, args=("first", 300))
    first.start()
    _until(lambda: q.depth() == 1)
    second = threading.Thread(target=waiter, args=("second", 10))  # would fit now, but may not overtake
    second.start()
    _until(lambda: q.depth() == 2)
    with pytest.raises(ResourceExhausted) as caught:
        admit(q, 1, 1)
    assert str(caught.value) == ("the admission queue for model 'm' is full (2 requests waiting for KV headroom, "
                                 "limit 2); retry later")
    time.sleep(0.3)
    assert placed == []  # second stays behind first although 20 tokens are free
    q.router.release(hog)
    first.join(5)
    second.join(5)
    assert [name for name, _ in placed] == ["first", "second"]
    assert q.depth() == 0 and a.kv_bytes_reserved == 310 * BPT


def test_queue_deadline_gives_resource_exhausted():
    q = queue_over(view("a"), max_size=4, max_wait_s=0.3)
    admit(q, 320, 300)
    t0 = time.monotonic()
    with pytest.raises(ResourceExhausted) as caught:
        admit(q, 50, 50)
    assert 0.3 <= time.monotonic() - t0 < 1.5
    assert str(caught.value) == ("no replica group had KV headroom for this request (50 prompt + 50 completion "
                                 "tokens) within the queue deadline of 0.3 s; retry later")
    assert q.depth() == 0


def test_no_queue_means_resource_exhausted_at_once():
    q = queue_over(view("a"), max_size=0)
    admit(q, 320, 300)
    with pytest.raises(ResourceExhausted, match=r"full \(0 requests waiting for KV headroom, limit 0\)"):
        admit(q, 50, 50)


def test_a_cancelled_waiter_leaves_the_queue_and_the_next_moves_up():
    q = queue_over(view("a"), max_size=4, max_wait_s=10.0)
    hog = admit(q, 320, 300)
    cancelled = threading.Event()
    outcome: list[BaseException] = []

    def waiter() -> None:
        try:
            admit(q, 100, 100, cancelled=cancelled)
        except BaseException as exc:  # noqa: BLE001
            outcome.append(exc)

    thread = threading.Thread(target=waiter)
    thread.start()
    _until(lambda: q.depth() == 1)
    cancelled.set()
    q.wake()
    thread.join(2)
    assert isinstance(outcome[0], RequestCancelled) and q.depth() == 0
    assert hog.group.kv_bytes_reserved == 620 * BPT  # the cancelled request reserved nothing


def test_a_waiter_whose_groups_fail_leaves_with_unavailable():
    a = view("a")
    q = queue_over(a, max_size=4, max_wait_s=10.0)
    admit(q, 320, 300)
    outcome: list[BaseException] = []
    thread = threading.Thread(target=lambda: outcome.extend(_raised(lambda: admit(q, 100, 100))))
    thread.start()
    _until(lambda: q.depth() == 1)
    q.replicas.mark_failed(a, "replica group a failed: collective timed out")
    thread.join(2)
    assert isinstance(outcome[0], Unavailable)
    assert "a: unhealthy (replica group a failed: collective timed out)" in str(outcome[0])


def test_admit_now_reserves_rejects_or_says_the_request_must_queue_without_waiting():
    a = view("a")
    q = queue_over(a, max_size=1, max_wait_s=10.0)
    with pytest.raises(InvalidArgument, match="maximum context length is 2048 tokens"):
        q.admit_now("m", 2000, 100, max_model_len=2048)
    hog = q.admit_now("m", 320, 300, max_model_len=2048, request_id="hog")
    assert hog is not None and hog.request_id == "hog" and a.kv_bytes_reserved == 620 * BPT
    assert q.admit_now("m", 50, 50, max_model_len=2048) is None  # no headroom: it would queue
    assert q.depth() == 0  # and nothing was queued or reserved for it
    waiter = threading.Thread(target=lambda: _raised(lambda: admit(q, 50, 50)))
    waiter.start()
    _until(lambda: q.depth() == 1)
    with pytest.raises(ResourceExhausted, match=r"full \(1 requests waiting for KV headroom, limit 1\)"):
        q.admit_now("m", 5, 5, max_model_len=2048)  # fits now, but may not overtake, and the queue is full
    q.router.release(hog)
    waiter.join(5)
    assert q.depth() == 0 and a.kv_bytes_reserved == 100 * BPT


def test_queue_config_is_validated():
    with pytest.raises(InvalidArgument, match="queue size must be >= 0, got -1"):
        QueueConfig(max_size=-1)
    with pytest.raises(InvalidArgument, match="queue wait must be > 0 seconds, got 0"):
        QueueConfig(max_wait_s=0)


def _raised(fn) -> list[BaseException]:
    try:
        fn()
    except BaseException as exc:  # noqa: BLE001
        return [exc]
    return []


def _until(condition, timeout_s: float = 3.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.01)
