"""Plan search: enumeration, feasibility, objectives, explanations, infeasible requests."""

from __future__ import annotations

import pytest
import yaml

from services.planner import render
from services.planner.cost_model import LayoutError, Workload
from services.planner.search import NoFeasiblePlanError, PlannerError, PlanRequest, enumerate_candidates, search
from services.planner.specs import PRESETS, parse_dtypes
from services.planner.topology import GIB
from services.planner.topology import PRESETS as TOPOLOGIES

LLAMA70 = PRESETS["llama3-70b"]
A100 = TOPOLOGIES["a100-80g-8x"]


def by_label(result, label: str):
    matches = [a for a in result.assessments if a.candidate.label == label]
    assert len(matches) == 1, label
    return matches[0]


def test_done_when_figures_for_llama3_70b_in_the_json() -> None:
    result = search(PlanRequest(LLAMA70, A100, dtypes=("fp16",)))
    data = render.plan_dict(result)
    assert abs(data["model"]["parameters"] - 70.55e9) < 0.01e9
    assert data["model"]["kv_bytes_per_token"] == 327_680
    tp4pp2 = [c for c in data["candidates"] if (c["tp"], c["pp"]) == (4, 2)]
    assert len(tp4pp2) == 1
    c = tp4pp2[0]
    assert c["dtype"] == "float16" and c["gpus"] == 8 and c["feasible"] and c["rejected_reason"] is None
    assert c["kv_bytes_per_token_per_gpu"] == 40_960
    assert c["kv_tokens_per_gpu"] == 524_288
    assert c["max_concurrent_sequences"] == 256
    assert c["replicas_per_node"] == 1
    assert c["bubble_fraction"] == pytest.approx(1 / 3)
    for key in ("weight_bytes_per_gpu", "predicted_tpot_ms", "tokens_per_s_per_replica", "usd_per_million_tokens"):
        assert c[key] > 0
    assert data["chosen"]["feasible"] and data["chosen"]["chosen"]


def test_enumeration_covers_tp_dividing_heads_and_pp_up_to_the_budget() -> None:
    request = PlanRequest(LLAMA70, A100)
    layouts = {(c.tp, c.pp) for c in enumerate_candidates(request)}
    # TP ∈ {1, 2, 4, 8} (divisors of 64 within 8 GPUs), PP while tp · pp ≤ 8.
    expected = {(tp, pp) for tp in (1, 2, 4, 8) for pp in range(1, 9) if tp * pp <= 8}
    assert layouts == expected
    smol = PlanRequest(PRESETS["smollm2-135m"], A100, dtypes=("float32",))
    assert {c.tp for c in enumerate_candidates(smol)} == {1, 3}  # 9 heads: TP 9 exceeds 8 GPUs


def test_every_candidate_is_explained() -> None:
    result = search(PlanRequest(LLAMA70, A100))
    assert sum(a.chosen for a in result.assessments) == 1
    for a in result.assessments:
        assert a.verdict, a.candidate.label
        if a.feasible:
            assert a.rejected_reason is None
        else:
            assert a.verdict == f"rejected: {a.rejected_reason}"
    # TP2/PP1 fp16 holds 65.7 GiB of weights: rejected for memory with the shortfall in bytes.
    tp2 = by_label(result, "TP2/PP1 float16")
    assert not tp2.feasible and tp2.shortfall_bytes > 0
    assert f"short by {tp2.shortfall_bytes:,} B" in tp2.rejected_reason
    assert tp2.shortfall_bytes == tp2.estimate.weight_bytes_per_gpu + 3 * GIB + 20 * GIB - 80 * GIB


# The realistic input where the three objectives disagree: Llama-3-8B on 8×H100 for short chats
# (512-token contexts) in fp16.
H100 = TOPOLOGIES["h100-80g-8x"]
SHORT_CHAT = dict(model=PRESETS["llama3-8b"], topology=H100, dtypes=parse_dtypes("fp16"),
                  workload=Workload(avg_context=512))


def test_objectives_pick_different_plans() -> None:
    picks = {obj: search(PlanRequest(**SHORT_CHAT, objective=obj)) for obj in ("balanced", "cost", "latency")}
    assert picks["latency"].chosen.candidate.label == "TP8/PP1 float16"
    assert picks["balanced"].chosen.candidate.label == "TP4/PP1 float16"
    assert picks["cost"].chosen.candidate.label == "TP2/PP1 float16"

    lat, bal, cost = (picks[o].chosen.estimate for o in ("latency", "balanced", "cost"))
    # balanced: within 10 % of the best TPOT, and cheaper than the latency pick
    assert lat.tpot_batch1_s < bal.tpot_batch1_s <= 1.10 * lat.tpot_batch1_s
    assert bal.usd_per_million_tokens < lat.usd_per_million_tokens
    # cost: cheapest of all (TP4 ties within 2 % and the tie goes to the smaller TP group), but
    # outside the latency band
    assert cost.usd_per_million_tokens <= bal.usd_per_million_tokens
    assert cost.tpot_batch1_s > 1.10 * lat.tpot_batch1_s


def test_table_explains_the_choice_and_every_loser() -> None:
    result = search(PlanRequest(**SHORT_CHAT, objective="balanced"))
    table = render.plan_table(result)
    assert "Chosen: TP4/PP1 float16 — cheapest ($0.032/M output tokens) within 10% of the best TPOT (1.48 ms" in table
    assert ("  TP8/PP1 float16: dearer: $0.039/M output tokens vs $0.032 (+19.8%); 2.5% faster, but the band "
            "allows 10%") in table
    assert ("  TP1/PP1 float16: outside the latency band: TPOT 4.50 ms > 1.10 × best 1.48 ms, and 16.7% dearer "
            "($0.038/M output tokens)") in table
    explained = [line for line in table.splitlines() if line.startswith("  TP")]
    assert len(explained) == len(result.assessments) - 1  # one line per candidate that lost

    cost_table = render.plan_table(search(PlanRequest(**SHORT_CHAT, objective="cost")))
    assert "Chosen: TP2/PP1 float16 — lowest $/M output tokens ($0.032); 1 other plan(s) cost within 2%" in cost_table
    assert "  TP1/PP1 float16: dearer: $0.038/M output tokens vs $0.032 (+17.7%)" in cost_table
    latency_table = render.plan_table(search(PlanRequest(**SHORT_CHAT, objective="latency")))
    assert "Chosen: TP8/PP1 float16 — lowest TPOT at batch 1 (1.48 ms)" in latency_table
    assert "  TP4/PP1 float16: slower: TPOT 1.52 ms vs 1.48 ms (+2.6%)" in latency_table


def test_cost_ties_go_to_the_smaller_tp_group() -> None:
    # Llama-3-8B fp16 on H100 at 512-token contexts: TP2 and TP4 cost the same per token (the
    # step reads the whole 20 GiB KV cap either way); the tie goes to TP2, the smaller group.
    base = dict(model=PRESETS["llama3-8b"], topology=TOPOLOGIES["h100-80g-8x"], workload=Workload(avg_context=512))
    cost = search(PlanRequest(**base, objective="cost"))
    assert cost.chosen.candidate.label == "TP2/PP1 float16"
    tp4 = by_label(cost, "TP4/PP1 float16")
    assert tp4.verdict.startswith("ties on cost")
    assert search(PlanRequest(**base, objective="balanced")).chosen.candidate.label == "TP4/PP1 float16"
    assert search(PlanRequest(**base, objective="latency")).chosen.candidate.label == "TP8/PP1 float16"


def test_405b_fp16_on_one_node_fails_naming_the_closest_plan() -> None:
    request = PlanRequest(PRESETS["llama3.1-405b"], A100, dtypes=("fp16",))
    with pytest.raises(NoFeasiblePlanError) as info:
        search(request)
    err = info.value
    assert err.closest is not None and err.closest.candidate.gpus == 8
    assert err.shortfall_bytes == err.closest.estimate.memory_needed_bytes - 80 * GIB > 30 * GIB
    message = str(err)
    assert "no shard plan fits llama3.1-405b at float16 on a100-80g-8x" in message
    assert f"Closest: {err.closest.candidate.label} (8 GPUs)" in message
    assert f"short by {err.shortfall_bytes:,} B" in message
    assert "--max-nodes 2" in message and "--dtype fp8" in message


def test_fixed_layout_is_evaluated_alone() -> None:
    result = search(PlanRequest(LLAMA70, A100, tp=4, pp=2))
    assert [a.candidate.label for a in result.assessments] == ["TP4/PP2 float16"]
    assert result.chosen.estimate.max_concurrent_sequences == 256
    # A fixed degree that cannot shard the model is a bad argument (INVALID_ARGUMENT over gRPC),
    # not a hardware shortfall.
    with pytest.raises(LayoutError, match="tp 3 does not divide the 64 attention heads"):
        search(PlanRequest(LLAMA70, A100, tp=3, pp=1))
    with pytest.raises(LayoutError, match="pp 81 exceeds the model's 80 layers"):
        search(PlanRequest(LLAMA70, A100, pp=81))


def test_cross_node_tp_only_when_allowed() -> None:
    two_nodes = dict(model=LLAMA70, topology=A100, max_nodes=2, tp=16, pp=1)
    with pytest.raises(NoFeasiblePlanError, match="exceeds the NVLink domain of 8"):
        search(PlanRequest(**two_nodes))
    result = search(PlanRequest(**two_nodes, allow_cross_node_tp=True))
    est = result.chosen.estimate
    assert est.tp_link == "network" and est.kv_replication == 2
    # the same 160 all-reduces per token on InfiniBand instead of NVLink
    tp8 = search(PlanRequest(LLAMA70, A100, tp=8, pp=1)).chosen
    assert est.all_reduce_decode_s > 10 * tp8.estimate.all_reduce_decode_s
    # above TP 8 the layout-invariant numerics (the default) do not reach: the deploy config says so
    assert yaml.safe_load(render.shard_plan_yaml(PlanRequest(**two_nodes, allow_cross_node_tp=True),
                                                 result.chosen))["replica_group"]["numerics"] == "per-layout"
    assert "numerics" not in yaml.safe_load(render.shard_plan_yaml(PlanRequest(LLAMA70, A100, tp=8, pp=1),
                                                                   tp8))["replica_group"]


def test_bad_requests() -> None:
    with pytest.raises(PlannerError, match="unknown objective 'fast'"):
        PlanRequest(LLAMA70, A100, objective="fast")
    with pytest.raises(PlannerError, match="max_nodes must be a positive integer, got 0"):
        PlanRequest(LLAMA70, A100, max_nodes=0)
