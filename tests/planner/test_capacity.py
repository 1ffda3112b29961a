"""Capacity: replicas and nodes for a demand, TPOT targets, the autoscaling block."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from services.planner.capacity import AutoscalingPolicy, CapacityError, Demand, plan_capacity
from services.planner.cost_model import Candidate, CostModel, Workload
from services.planner.specs import PRESETS
from services.planner.topology import PRESETS as TOPOLOGIES

LLAMA70 = PRESETS["llama3-70b"]
A100 = TOPOLOGIES["a100-80g-8x"]
TP4PP2 = Candidate(4, 2, "fp16")


def test_seed_capacity_example() -> None:
    cap = plan_capacity(LLAMA70, A100, TP4PP2, Workload(seq_tokens_per_s=40.0), Demand(400, 300))
    assert cap.concurrency_per_replica == 256
    assert cap.tokens_per_s_per_replica == 10_240
    assert cap.demand.output_tokens_per_s == 120_000
    assert cap.replicas_exact == pytest.approx(120_000 / 10_240)
    assert cap.replicas == 12 and cap.nodes == 12 and cap.gpus == 96
    assert cap.replicas_below_scale_out == math.ceil(120_000 / 10_240 / 0.8) == 15
    assert cap.autoscaling == AutoscalingPolicy(min_replicas=4, max_replicas=24)
    assert (cap.autoscaling.scale_on, cap.autoscaling.scale_out_threshold, cap.autoscaling.scale_in_threshold) == (
        "kv_cache_utilization_pct", 80, 35)


def test_exact_multiple_does_not_round_up() -> None:
    cap = plan_capacity(LLAMA70, A100, TP4PP2, Workload(seq_tokens_per_s=40.0), Demand(10_240 * 3 / 300, 300))
    assert cap.replicas == 3


def test_replicas_pack_onto_nodes() -> None:
    # TP4/PP1 fp16 fits twice on an 8-GPU node: 5 replicas need 3 nodes.
    est = CostModel(LLAMA70, A100, Workload(seq_tokens_per_s=40.0)).estimate(Candidate(4, 1, "fp16"))
    per_replica = est.max_concurrent_sequences * 40.0
    cap = plan_capacity(LLAMA70, A100, Candidate(4, 1, "fp16"), Workload(seq_tokens_per_s=40.0),
                        Demand(per_replica * 4.5 / 100, 100))
    assert cap.replicas == 5 and cap.nodes == 3 and cap.gpus == 20


def test_predicted_rate_is_used_without_an_override() -> None:
    cm = CostModel(LLAMA70, A100)
    tpot = cm.tpot_s(TP4PP2, 256)
    cap = plan_capacity(LLAMA70, A100, TP4PP2, Workload(), Demand(400, 300))
    assert cap.seq_rate_source == "predicted"
    assert cap.tpot_s == pytest.approx(tpot)
    assert cap.tokens_per_s_per_replica == pytest.approx(256 / tpot)
    assert cap.replicas == math.ceil(120_000 / (256 / tpot))


def test_tpot_target_lowers_concurrency() -> None:
    cm = CostModel(LLAMA70, A100)
    target = 0.030
    cap = plan_capacity(LLAMA70, A100, TP4PP2, Workload(), Demand(400, 300, tpot_target_s=target))
    c = cap.concurrency_per_replica
    assert 1 <= c < 256
    assert cm.tpot_s(TP4PP2, c) <= target < cm.tpot_s(TP4PP2, c + 1)
    unconstrained = plan_capacity(LLAMA70, A100, TP4PP2, Workload(), Demand(400, 300))
    assert cap.replicas > unconstrained.replicas


def test_unreachable_targets_and_misfits_say_the_numbers() -> None:
    with pytest.raises(CapacityError, match=r"predicted TPOT at batch 1 is 18\.\d\d ms, above the target 5\.00 ms"):
        plan_capacity(LLAMA70, A100, TP4PP2, Workload(), Demand(1, 100, tpot_target_s=0.005))
    with pytest.raises(CapacityError, match=r"--seq-tokens-per-s 40 means a TPOT of 25\.00 ms, above the target 20\.00 ms"):
        plan_capacity(LLAMA70, A100, TP4PP2, Workload(seq_tokens_per_s=40.0), Demand(1, 100, tpot_target_s=0.020))
    with pytest.raises(CapacityError, match="TP2/PP1 float16 does not fit llama3-70b on a100-80g-8x: short by"):
        plan_capacity(LLAMA70, A100, Candidate(2, 1, "fp16"), Workload(), Demand(1, 100))
    with pytest.raises(CapacityError, match="req_per_s must be > 0"):
        Demand(0, 100)
    with pytest.raises(CapacityError, match="need 1 ≤ min_replicas ≤ max_replicas, got min 5, max 2"):
        AutoscalingPolicy(5, 2)


@given(st.floats(1, 5000), st.integers(1, 4000), st.floats(5, 100))
def test_littles_law_agrees_with_token_rate_sizing(req_per_s: float, output_tokens: int, rate: float) -> None:
    cap = plan_capacity(LLAMA70, A100, TP4PP2, Workload(seq_tokens_per_s=rate), Demand(req_per_s, output_tokens))
    in_flight = req_per_s * output_tokens / rate  # sequences decoding at once (Little's law)
    assert cap.replicas == max(1, math.ceil(round(in_flight / 256, 9)))
    assert cap.replicas * cap.tokens_per_s_per_replica >= cap.demand.output_tokens_per_s * (1 - 1e-9)
    assert cap.autoscaling.min_replicas <= cap.replicas <= cap.autoscaling.max_replicas
