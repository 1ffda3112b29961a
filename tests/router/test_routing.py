"""Routing by KV headroom: estimates, the pick, reservations, their release (pure, exact)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from services.common.group_status import GroupStatus
from services.common.prefix_blocks import block_hashes
from services.router.replicas import ReplicaGroupView, ReplicaSet, WorkerStats
from services.router.routing import PromptPrefix, Router, fits_group, kv_estimate, pick

BPT = 2048  # KV bytes per token of the tiny model at TP2 (per rank)


def view(gid: str, *, used_tokens: int = 0, capacity_tokens: int = 640, bpt: int = BPT,
         status: GroupStatus = GroupStatus.HEALTHY, max_model_len: int = 2048, model: str = "m") -> ReplicaGroupView:
    return ReplicaGroupView(address=f"{gid}:1", replica_group_id=gid, model=model, kv_bytes_used=used_tokens * bpt,
                            kv_bytes_capacity=capacity_tokens * bpt, kv_bytes_per_token=bpt,
                            max_model_len=max_model_len, status=status)


def replica_set(*views: ReplicaGroupView) -> ReplicaSet:
    replicas = ReplicaSet()
    for v in views:
        replicas._views[v.address] = v
        v.prefix_index = replicas.prefix_index
        for name in v.prefix_blocks:
            replicas.prefix_index.add(v, name)
    return replicas


def test_estimate_is_prompt_plus_completion_times_bytes_per_token():
    assert kv_estimate(100, 28, 40_960) == 128 * 40_960
    # Llama-3-70B fp16 at TP4/PP2: 2,048 tokens cost 80 MiB per GPU
    assert kv_estimate(1024, 1024, 40_960) == 83_886_080


def test_pick_takes_the_lowest_utilization_among_groups_with_headroom():
    a, b, c = view("a", used_tokens=320), view("b", used_tokens=100), view("c", used_tokens=600)
    assert pick([a, b, c], 10, 10) is b
    # b is least utilized but lacks headroom for 600 tokens; a has 320 free, c 40: none fits
    assert pick([a, b, c], 300, 300) is None
    # 500 tokens: only b (540 free) has room
    assert pick([a, b, c], 250, 250) is b
    assert pick([a, c], 100, 100) is a  # a: 320 free, c: 40 free


def test_a_group_running_a_shadow_score_is_picked_only_when_no_other_can_take_the_request():
    a, b = view("a", used_tokens=0), view("b", used_tokens=320)
    a.shadow_scores = 1  # the least utilized, but its engine is busy with a mirrored Score
    assert pick([a, b], 10, 10) is b
    assert pick([a, b], 200, 200) is a  # b has 320 tokens free: only a fits
    a.shadow_scores = 0
    assert pick([a, b], 10, 10) is a


def test_groups_with_different_plans_compare_by_their_own_bytes_per_token():
    # same bytes in use; the TP4 group pays a quarter per token, so its estimate is smaller
    small = view("tp1", used_tokens=0, capacity_tokens=100, bpt=4 * BPT)
    big = view("tp4", used_tokens=0, capacity_tokens=400, bpt=BPT)
    assert small.kv_bytes_capacity == big.kv_bytes_capacity
    assert pick([small, big], 60, 60) is big  # 120 tokens do not fit the 100-token group
    assert pick([small, big], 10, 10) is small  # a tie on utilization (0) goes to the lower id
    small.kv_bytes_used = 10 * 4 * BPT  # 10 % used on the small group: the big one wins
    assert pick([small, big], 10, 10) is big


def test_ties_go_to_the_lower_group_id():
    assert pick([view("rg-b"), view("rg-a")], 5, 5).replica_group_id == "rg-a"


@pytest.mark.parametrize("status", [GroupStatus.UNHEALTHY, GroupStatus.DRAINING, GroupStatus.DEAD,
                                    GroupStatus.PROVISIONING])
def test_groups_that_are_not_routable_get_nothing(status):
    sick, busy = view("a", status=status), view("b", used_tokens=500)
    assert pick([sick, busy], 10, 10) is busy
    assert pick([sick], 10, 10) is None


def test_degraded_groups_still_take_requests():
    assert pick([view("a", status=GroupStatus.DEGRADED)], 10, 10).replica_group_id == "a"


def test_fits_group_checks_the_whole_budget_and_the_context():
    g = view("a", capacity_tokens=640, max_model_len=641)
    assert fits_group(g, 600, 40) and not fits_group(g, 600, 41)
    assert not fits_group(view("b", capacity_tokens=10_000, max_model_len=512), 500, 13)
    assert not fits_group(ReplicaGroupView(address="x"), 1, 1)  # not reported yet


def test_reservations_count_until_released_and_steer_the_next_pick():
    a, b = view("a"), view("b")
    router = Router(replica_set(a, b))
    first = router.try_reserve("m", 100, 200, request_id="r1")
    assert first.group is a and first.kv_bytes == 300 * BPT
    assert (a.kv_bytes_reserved, a.committed_bytes, a.headroom_bytes) == (300 * BPT, 300 * BPT, 340 * BPT)
    assert a.utilization == pytest.approx(300 / 640)
    second = router.try_reserve("m", 10, 10, request_id="r2")
    assert second.group is b  # a is now the busier one
    third = router.try_reserve("m", 300, 300, request_id="r3")
    assert third.group is b  # a has 340 tokens free, b 620
    assert router.try_reserve("m", 200, 200, request_id="r4") is None  # a: 340 tokens free, b: 640 - 620 = 20
    router.release(first)
    assert a.kv_bytes_reserved == 0 and first.released
    router.release(first)  # idempotent
    assert a.kv_bytes_reserved == 0
    assert router.try_reserve("m", 200, 200, request_id="r4").group is a
    assert router.try_reserve("other-model", 1, 1) is None


def test_worker_reports_replace_the_materialized_part_of_a_reservation():
    a = view("a")
    replicas = replica_set(a)
    router = Router(replicas)
    r = router.try_reserve("m", 100, 100)
    # queued in the worker, nothing generated: the whole estimate is outstanding
    assert a.committed_bytes == 200 * BPT
    # the worker reports its prompt's blocks (7 blocks of 16 = 112 tokens) before the first token
    stats = WorkerStats("a", "m", 2, 1, "float32", kv_bytes_used=112 * BPT, kv_bytes_capacity=640 * BPT,
                        kv_bytes_per_token=BPT, max_model_len=641)
    a.apply_stats(stats, now=1.0, wall_ms=1)
    assert r.materialized_bytes == 0 and a.committed_bytes == (112 + 200) * BPT  # counted twice: safe side
    # after 20 tokens, the next report covers prompt + 20 tokens of ours
    r.generated = 20
    a.apply_stats(stats, now=1.25, wall_ms=2)
    assert r.materialized_bytes == 120 * BPT
    assert a.outstanding_bytes == 80 * BPT
    # 112 + 80 tokens by the blocks, but the worker admits by whole claims: our 200 still count
    assert a.committed_bytes == 200 * BPT
    # never more than the estimate, whatever the count says
    r.generated = 500
    a.apply_stats(stats, now=1.5, wall_ms=3)
    assert r.materialized_bytes == r.kv_bytes and a.outstanding_bytes == 0
    router.release(r)
    assert a.committed_bytes == 112 * BPT


def test_claims_admitted_through_other_routers_count_and_a_refusal_closes_the_group_until_its_next_report():
    a, b = view("a"), view("b")
    replicas = replica_set(a, b)
    router = Router(replicas)
    mine = router.try_reserve("m", 100, 100)
    assert mine.group is a
    # the worker holds our 200 tokens and 300 more from another router, none of it in blocks yet
    stats = WorkerStats("a", "m", 2, 1, "float32", kv_bytes_used=0, kv_bytes_capacity=640 * BPT,
                        kv_bytes_per_token=BPT, max_model_len=2048, kv_bytes_admitted=500 * BPT)
    a.apply_stats(stats, now=1.0, wall_ms=1)
    assert a.kv_bytes_claimed_elsewhere == 300 * BPT and a.committed_bytes == 500 * BPT
    assert router.try_reserve("m", 100, 100).group is b  # a has 140 tokens left, b 640
    # a worker's refusal: nothing more goes to a until it reports again
    replicas.mark_full(b)
    assert b.headroom_bytes <= 0 and router.try_reserve("m", 10, 10).group is a
    b.apply_stats(replace(stats, replica_group_id="b", kv_bytes_admitted=200 * BPT), now=2.0, wall_ms=2)
    assert b.kv_bytes_claimed_elsewhere == 0 and b.committed_bytes == 200 * BPT


# ---- prefix affinity ---------------------------------------------------------------------


def cached(v: ReplicaGroupView, token_ids: list[int], block_size: int = 4) -> ReplicaGroupView:
    """``v`` holding every full block of ``token_ids`` in its prefix cache (and its set's index)."""
    v.block_size = block_size
    for name in block_hashes(token_ids, block_size):
        v.prefix_blocks.add(name)
        if v.prefix_index is not None:
            v.prefix_index.add(v, name)
    return v


def reusable(prompt: PromptPrefix, index, v: ReplicaGroupView) -> int:
    """Prompt tokens ``v``'s prefix cache holds, from the first (blocks of 4 tokens)."""
    return prompt.deepest_holders(index, 4, {v})[0]


def test_prefix_affinity_takes_the_group_caching_most_of_the_prompt():
    system = list(range(10, 30))  # 5 blocks of 4
    a, b, c = view("a"), cached(view("b", used_tokens=300), system[:8]), cached(view("c", used_tokens=500), system)
    index = replica_set(a, b, c).prefix_index
    prompt = PromptPrefix(system + [7, 7, 7])
    assert [reusable(prompt, index, v) for v in (c, b, a)] == [20, 8, 0]
    assert prompt.deepest_holders(index, 4, {a, b, c}) == (20, {c})
    assert prompt.deepest_holders(index, 4, {a, b}) == (8, {b})
    assert pick([a, b, c], 23, 10, prompt, index) is c
    assert pick([a, b, c], 23, 10) is a  # the headroom rule alone
    # the last token always runs: a prompt that is exactly the cached blocks reuses all but the last
    assert reusable(PromptPrefix(system), index, c) == 16
    # another salt shares nothing; a prompt that matches no group follows the headroom rule
    assert reusable(PromptPrefix(system + [7], salt="t"), index, c) == 0
    assert pick([a, b, c], 23, 10, PromptPrefix([99] * 23), index) is a
    # the fit rule stands: c has 140 tokens of headroom, b 340: 323 tokens go to b
    assert pick([a, b, c], 23, 300, prompt, index) is b


def test_a_hot_prefix_spreads_once_its_group_is_busier_than_the_slack():
    system = list(range(10, 30))
    a, b = view("a"), view("b")
    replicas = replica_set(a, b)
    cached(a, system)
    router = Router(replicas)
    prompt = PromptPrefix(system + [1])
    held = [router.try_reserve("m", 21, 4, prefix=prompt) for _ in range(3)]
    assert [r.group for r in held] == [a, a, a]  # a: 2 more than b's 0 is within load_slack(0) = 2
    assert router.try_reserve("m", 21, 4, prefix=prompt).group is b  # 3 > 0 + 2: the headroom rule
    cached(b, system)  # b computed it: a second home
    assert router.try_reserve("m", 21, 4, prefix=prompt).group is b  # equal hits: the less busy one
    x, y = view("x"), view("y")
    headroom_only = Router(replica_set(x, y), prefix_affinity=False)
    cached(y, system)
    assert headroom_only.try_reserve("m", 21, 4, prefix=prompt).group is x
    for r in held:
        router.release(r)


def test_the_view_mirrors_snapshots_and_events_in_order():
    v = view("a")
    index = replica_set(v).prefix_index
    stats = WorkerStats("a", "m", 1, 1, "bfloat16", 0, 1000, 10, 100, block_size=4, prefix_epoch="e1",
                        prefix_seq=2, prefix_snapshot=True, prefix_events=[(b"x", False), (b"y", False)])
    v.apply_stats(stats, now=1.0, wall_ms=1)
    assert v.prefix_blocks == {b"x", b"y"} and (v.prefix_epoch, v.prefix_seq, v.block_size) == ("e1", 2, 4)
    later = WorkerStats("a", "m", 1, 1, "bfloat16", 0, 1000, 10, 100, block_size=4, prefix_epoch="e1", prefix_seq=5,
                        prefix_events=[(b"x", True), (b"z", False), (b"z", True)])
    v.apply_stats(later, now=2.0, wall_ms=2)
    assert v.prefix_blocks == {b"y"} and v.prefix_seq == 5 and index.holders == {b"y": {v}}
    v.apply_stats(WorkerStats("a", "m", 1, 1, "bfloat16", 0, 1000, 10, 100), now=3.0, wall_ms=3)
    assert v.prefix_blocks == set() and v.prefix_epoch == ""  # no prefix caching there now
    assert index.holders == {}
    v.apply_stats(stats, now=4.0, wall_ms=4)
    assert index.holders == {b"x": {v}, b"y": {v}}
    v.registry_status = "dead"  # a dead group's names leave the index
    assert v.refresh_status(4.0) is GroupStatus.DEAD and index.holders == {} and v.prefix_epoch == ""
