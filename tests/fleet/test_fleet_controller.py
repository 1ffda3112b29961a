"""The fleet controller on real processes: a router discovering groups in a PostgreSQL registry,
``shardline serve fleet --keep-groups`` with the local provisioner, Redis as the health store, and
8 greedy clients looping through the ``openai`` client, every completion checked against its
fault-free text. One stack for the module, one fleet through five scenarios in order, and in them
the controller SIGKILLed and replaced by a new one at five moments (its groups live on; the new
one adopts them and finishes what the old one was doing, from the registry alone):

1. heal: SIGKILL the worker process of one of two groups; nothing fails, and a new group of the
   same plan is in rotation within collective timeout + start-up + 10 s, the old one dead with why
   (the controller killed while the replacement loads: **mid-heal**);
2. re-shard: TP1 x PP1 -> TP1 x PP2 (bfloat16) under load: no failed request, never fewer than 2 groups in
   rotation (the router's view), identical outputs, the gate's figures per new group, the rollout
   succeeded once (the controller killed while the first candidate loads, **mid-surge**, and
   again once a candidate is being gated, **mid-gate**);
3. a rollout whose candidate fails the gate (weights with planted noise) ends ``failed``, the
   groups of the serving revision still serving;
4. a rollout to int8 weights under load: nothing fails, never fewer than 2 groups in rotation,
   each new group's gate figures recorded (the controller killed while an old group drains,
   **mid-drain**);
5. autoscaling (min 1, max 2): streams that fill the KV cache add a group; without them it scales
   back to 1, draining without a failed request (the controller killed while the added group
   loads, **mid-scale-out**).
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from bench._fleet_stack import FleetStack, Load, RotationMonitor, driver_pid, fleet_spec
from tests.stack import fresh_database

pytestmark = pytest.mark.slow

FLEET = "tinyfleet"
PROMPTS = [f"story number {i}: once upon a time" for i in range(8)]
MAX_TOKENS = 24
# 4 clients with 2 s of think time each (~1.7 requests a second): load that crosses every rollout,
# heal, drain and controller restart, and leaves the 2 cores room to start groups. The load is most
# of the module's CPU: on the AVX2 EPYC a request of 24 tokens costs 0.18 core-s (client, router,
# a PP2 worker), so 6 clients at 1.5 s (3.2 a second) took 0.7 of the 2 cores for the whole module.
STREAMS = 4
PAUSE_S = 2.0
COLLECTIVE_TIMEOUT_S = 2.0
# bfloat16, as served: on CPU its matmuls and attention are batch-invariant (a sequence's bits do
# not depend on what shares its steps), so a text is the same in any batch and in either layout
DTYPE = "bfloat16"
# 1 MiB per rank: 512 tokens of a PP1 group, 1024 of a PP2 group (bfloat16, 2 KiB a token over the 4 layers)
KV_CACHE_GB = 1 / 1024


def spec(**overrides):
    """The fleet's spec, kept short for the suite: a gate of 4 x 128 tokens, 5 s drains, 1 s settles."""
    return fleet_spec(FLEET, overrides.pop("model_dir"), dtype=overrides.pop("dtype", DTYPE), gate_chunk_tokens=128,
                      drain_deadline_s=5.0, settle_s=1.0,
                      kv_cache_cap_gb=KV_CACHE_GB, **overrides)


@pytest.fixture(scope="module")
def stack(tiny_model_dir: Path, postgres_url: str, redis_url: str,
          tmp_path_factory: pytest.TempPathFactory) -> Iterator[FleetStack]:
    with fresh_database(postgres_url, "fleet") as db:
        fleet = FleetStack(tmp_path_factory.mktemp("fleet"), tiny_model_dir, FLEET, db, redis_url=redis_url,
                           keep_groups=True)
        try:
            fleet.start(spec(model_dir=tiny_model_dir), groups=2)
            yield fleet
        finally:
            fleet.close()


@pytest.fixture(scope="module")
def expected(stack: FleetStack) -> dict[int, str]:
    """Each prompt's fault-free greedy text, from the fleet before anything happens to it."""
    load = Load(stack.http, "tinyfleet", PROMPTS, MAX_TOKENS, concurrency=1)
    outcomes = [load.one(i) for i in range(len(PROMPTS))]
    assert all(o.ok for o in outcomes), [o.error for o in outcomes]
    return {o.prompt: o.text for o in outcomes}


def check_outcomes(outcomes: list, expected: dict[int, str] | None) -> None:
    """No request failed and (``expected`` given) every text is its fault-free one."""
    assert outcomes, "the load ran no request"
    failed = [o for o in outcomes if not o.ok]
    assert not failed, f"{len(failed)} of {len(outcomes)} failed: {failed[:3]}"
    if expected is None:
        return
    wrong = [o for o in outcomes if o.text != expected[o.prompt]]
    assert not wrong, f"{len(wrong)} of {len(outcomes)} differ from the fault-free text: {wrong[:3]}"


def rollout_ended(stack: FleetStack) -> bool:
    """The rollout to the newest revision succeeded or failed."""
    status = stack.status()
    rollout = status["rollout"]
    return rollout is not None and rollout["to_revision"] == status["revision"] and \
        rollout["status"] in ("succeeded", "failed")


def live_groups(stack: FleetStack) -> dict[str, dict]:
    return {g["id"]: g for g in stack.status()["groups"] if g["status"] != "dead"}


def kill_controller_when(stack: FleetStack, moment: Callable[[], bool], what: str, *, unless=lambda: False) -> bool:
    """SIGKILL the controller once ``moment`` holds and start a new one; False (nothing killed)
    when ``unless`` came first (the step it waited for was already over)."""
    stack.wait(lambda: unless() or moment(), 90, what)
    if unless():
        print(f"not killed {what}: it was over first")
        return False
    stack.kill_controller()
    print(f"controller {stack.controllers - 1} SIGKILLed {what}; controller {stack.controllers} started")
    return True


def provisioning(stack: FleetStack, plan: str | None = None) -> bool:
    return any(g["status"] == "provisioning" and plan in (None, g["plan"]) for g in live_groups(stack).values())


def successes(rollout: dict) -> int:
    return sum(e["event"] == "rollout-succeeded" for e in rollout["events"])


def test_heal_replaces_a_killed_group_with_the_same_plan(stack: FleetStack, expected: dict[int, str]) -> None:
    before = live_groups(stack)
    assert len(before) == 2 and all(g["status"] == "healthy" for g in before.values())
    victim = sorted(before)[0]
    load = Load(stack.http, "tinyfleet", PROMPTS, MAX_TOKENS, concurrency=STREAMS, pause_s=PAUSE_S).start()
    time.sleep(1.0)
    os.kill(driver_pid(victim), signal.SIGKILL)
    killed = time.monotonic()
    kill_controller_when(stack, lambda: provisioning(stack), "mid-heal (the replacement loading)")

    def healed() -> bool:
        groups = live_groups(stack)
        return victim not in groups and sum(g["status"] == "healthy" for g in groups.values()) == 2

    took = stack.wait(healed, COLLECTIVE_TIMEOUT_S + 30 + 10, "a replacement group in rotation")
    time.sleep(1.0)
    check_outcomes(load.stop(), expected)
    status = stack.status()
    dead = {g["id"]: g for g in status["groups"]}[victim]
    assert dead["status"] == "dead" and "exited with code -9" in dead["reason"], dead
    new = set(live_groups(stack)) - set(before)
    assert len(new) == 1 and all(live_groups(stack)[g]["plan"] == before[victim]["plan"] for g in new)
    print(f"healed in {time.monotonic() - killed:.1f} s (wait {took:.1f} s): {victim} -> {new}")


def test_rolling_reshard_to_pp2_loses_nothing_and_keeps_two_groups_in_rotation(
        stack: FleetStack, expected: dict[int, str], tiny_model_dir: Path) -> None:
    stack.wait(lambda: len(stack.rotation()) == 2, 10, "the router to see both groups")
    monitor = RotationMonitor(stack).start()
    load = Load(stack.http, "tinyfleet", PROMPTS, MAX_TOKENS, concurrency=STREAMS, pause_s=PAUSE_S).start()
    time.sleep(1.0)
    print(stack.apply(spec(model_dir=tiny_model_dir, pp=2)))
    kill_controller_when(stack, lambda: provisioning(stack, "TP1 x PP2 bfloat16"), "mid-surge (a candidate loading)",
                         unless=lambda: rollout_ended(stack))
    gating = sum(e.startswith("gating ") for _, e in stack.events())
    kill_controller_when(stack, lambda: sum(e.startswith("gating ") for _, e in stack.events()) > gating,
                         "mid-gate (a candidate gated)", unless=lambda: rollout_ended(stack))
    stack.wait(lambda: rollout_ended(stack), 150, "the rollout to end")
    time.sleep(1.0)
    outcomes, samples = load.stop(), monitor.stop()
    check_outcomes(outcomes, expected)
    rollout = stack.rollout()
    assert rollout["status"] == "succeeded" and successes(rollout) == 1, rollout
    assert min(n for _, n, _ in samples) >= 2, f"fewer than 2 groups in rotation: {[n for _, n, _ in samples]}"
    groups = live_groups(stack)
    assert len(groups) == 2 and {g["plan"] for g in groups.values()} == {"TP1 x PP2 bfloat16"}
    gates = [e for e in rollout["events"] if e["event"] == "gate-passed"]
    assert {e["group"] for e in gates} == set(groups), gates
    assert all(e["perplexity_delta_pct"] == pytest.approx(0.0, abs=0.5) for e in gates)
    print(f"{len(outcomes)} requests, rotation min {min(n for _, n, _ in samples)}, gates {gates}")


def test_a_candidate_failing_the_gate_ends_the_rollout_failed_and_the_fleet_serving(
        stack: FleetStack, expected: dict[int, str], tiny_model_dir: Path) -> None:
    serving = live_groups(stack)
    load = Load(stack.http, "tinyfleet", PROMPTS, MAX_TOKENS, concurrency=STREAMS, pause_s=PAUSE_S).start()
    noisy = spec(model_dir=tiny_model_dir, pp=1, env={"SHARDLINE_WEIGHT_NOISE": "layer=1,std=0.5,seed=0"})
    print(stack.apply(noisy))
    stack.wait(lambda: rollout_ended(stack), 90, "the rollout to the noisy plan to end")
    time.sleep(1.0)
    check_outcomes(load.stop(), expected)
    rollout = stack.rollout()
    assert rollout["status"] == "failed" and "quality gate" in rollout["reason"], rollout
    failed = [e for e in rollout["events"] if e["event"] == "gate-failed"]
    assert failed and failed[0]["reasons"], failed  # the verdict's reasons (perplexity or top-1) are kept
    assert set(live_groups(stack)) == set(serving)  # the candidate is gone, the old groups serve
    assert len(stack.rotation()) == 2


def test_a_rolling_requantization_to_int8_loses_nothing_and_records_each_gate(
        stack: FleetStack, tiny_model_dir: Path) -> None:
    """bfloat16 -> int8 weights (the same PP2 layout): the texts change with the weights, so the
    check is that no request fails or breaks, rotation never drops below 2, and every new group's
    gate figures are in the rollout."""
    monitor = RotationMonitor(stack).start()
    load = Load(stack.http, "tinyfleet", PROMPTS, MAX_TOKENS, concurrency=STREAMS, pause_s=PAUSE_S).start()
    print(stack.apply(spec(model_dir=tiny_model_dir, pp=2, dtype="int8")))
    kill_controller_when(stack, lambda: any(g["status"] == "draining" for g in live_groups(stack).values()),
                         "mid-drain (an old group draining)", unless=lambda: rollout_ended(stack))
    stack.wait(lambda: rollout_ended(stack), 150, "the rollout to int8 to end")
    time.sleep(1.0)
    outcomes, samples = load.stop(), monitor.stop()
    check_outcomes(outcomes, None)  # the texts change with the weights
    rollout = stack.rollout()
    assert rollout["status"] == "succeeded" and successes(rollout) == 1, rollout
    assert min(n for _, n, _ in samples) >= 2, f"fewer than 2 groups in rotation: {[n for _, n, _ in samples]}"
    groups = live_groups(stack)
    assert len(groups) == 2 and {g["plan"] for g in groups.values()} == {"TP1 x PP2 int8"}, groups
    gates = [e for e in rollout["events"] if e["event"] == "gate-passed"]
    assert {e["group"] for e in gates} == set(groups), gates
    assert all("perplexity_delta_pct" in e and "top1_agreement" in e for e in gates), gates
    print(f"{len(outcomes)} requests, rotation min {min(n for _, n, _ in samples)}, gates {gates}")


def test_autoscaling_adds_groups_under_kv_pressure_and_scales_back_to_one(
        stack: FleetStack, tiny_model_dir: Path) -> None:
    # max 2: the third group a persisting pressure adds would cost a load and a drain and show
    # nothing more (the bounds are test_autoscale's)
    scaling = {"min_replicas": 1, "max_replicas": 2, "scale_out_threshold": 80, "scale_in_threshold": 35,
               "window_s": 1.5, "cooldown_s": 3}
    # the serving plan (PP2 int8) again, so no rollout: only the count is the autoscaler's now
    print(stack.apply(spec(model_dir=tiny_model_dir, pp=2, dtype="int8", replicas=2, autoscaling=scaling)))
    stack.wait(lambda: stack.status()["in_rotation"] == 1, 60, "scale-in to 1 without load")
    monitor = RotationMonitor(stack).start()
    # each request's KV estimate (prompt + 230 tokens) is near a quarter of a PP2 group's 1024: 4 run,
    # 4 wait at the router and take a slot the moment one ends, so the routers commit ~94 % of the
    # group until the added one comes, and both are busy then (12 streams kept a third round queued,
    # which stop() then waited out)
    load = Load(stack.http, "tinyfleet", PROMPTS, 230, concurrency=8, ignore_eos=True).start()
    kill_controller_when(stack, lambda: provisioning(stack), "mid-scale-out (the added group loading)",
                         unless=lambda: stack.status()["in_rotation"] >= 2)
    stack.wait(lambda: stack.status()["in_rotation"] >= 2, 90, "a scale-out under load")
    peak = stack.status()["in_rotation"]
    outcomes = load.stop()
    assert not [o for o in outcomes if not o.ok], [o.error for o in outcomes if not o.ok][:3]
    stack.wait(lambda: stack.status()["in_rotation"] == 1 and len(live_groups(stack)) == 1, 90,
               "scale-in back to 1")
    samples = monitor.stop()
    scales = [e for _, e in stack.events() if e.startswith("scale ")]
    assert any("desired=2" in e for e in scales) and peak >= 2, scales
    print(f"peak {peak} groups, max KV {max(u for _, _, u in samples):.0f} %, {len(outcomes)} requests; {scales}")
