"""PlannerService on a real gRPC server (loopback, in-process): Plan, Explain, Capacity, the
error statuses, and RecordPlan into a real PostgreSQL registry."""

from __future__ import annotations

import argparse
import json
import uuid
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import yaml
from sqlalchemy.engine import make_url

from services.common.config import ServerConfig
from services.common.grpc_server import GrpcServer, start_server
from services.common.proto import common_pb2, planner_pb2, planner_pb2_grpc
from services.common.registry import ShardRegistry
from services.planner import server as planner_server
from services.planner.topology import GIB
from tests.stack import fresh_database

FP16 = common_pb2.DTYPE_FLOAT16


def serve(registry_url: str) -> GrpcServer:
    args = argparse.Namespace(registry_url=registry_url)
    return start_server(ServerConfig(service="planner", port=0), planner_server.bindings(args))


@pytest.fixture
def sqlite_url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'registry.db'}"


@pytest.fixture
def stub(sqlite_url: str) -> Iterator[planner_pb2_grpc.PlannerServiceStub]:
    running = serve(sqlite_url)
    try:
        with grpc.insecure_channel(running.address) as channel:
            yield planner_pb2_grpc.PlannerServiceStub(channel)
    finally:
        running.stop(0)


def llama70(**fields) -> planner_pb2.PlanInputs:
    """The sizing example: Llama-3-70B on a100-80g-8x, fp16, 20 GiB KV cap, 2,048-token context."""
    base = dict(model_preset="llama3-70b", topology_preset="a100-80g-8x", dtypes=[FP16],
                kv_cache_cap_bytes_per_gpu=20 * GIB, avg_context_tokens=2048)
    return planner_pb2.PlanInputs(**(base | fields))


def test_plan_returns_the_section_6_numbers(stub: planner_pb2_grpc.PlannerServiceStub) -> None:
    response = stub.Plan(planner_pb2.PlanRequest(inputs=llama70(tp=4, pp=2)), timeout=30)
    assert abs(response.model.parameters - 70.55e9) < 0.01e9
    assert response.model.kv_bytes_per_token == 327_680
    assert response.model.num_layers == 80
    c = response.chosen
    assert (c.tp, c.pp, c.dtype, c.gpus, c.feasible, c.chosen) == (4, 2, FP16, 8, True, True)
    assert (c.kv_bytes_per_token_per_gpu, c.kv_tokens_per_gpu, c.max_concurrent_sequences) == (40_960, 524_288, 256)
    assert c.blast_radius_gpus == 8 and c.bubble_fraction == pytest.approx(1 / 3)
    assert c.predicted_tpot_ms > 0 and c.usd_per_million_tokens > 0
    assert response.explanation.startswith("chosen: ")
    plan_yaml = yaml.safe_load(response.shard_plan_yaml)
    group = plan_yaml["replica_group"]
    assert (group["tp_degree"], group["pp_degree"], group["dtype"]) == (4, 2, "float16")
    assert group["kv_cache_cap_gb"] == 20 and group["max_concurrent_sequences"] == 256


def test_plan_chooses_by_the_objective(stub: planner_pb2_grpc.PlannerServiceStub) -> None:
    # The search's own test input where the three objectives disagree (tests/planner/test_search.py).
    picks = {}
    for objective in (planner_pb2.OBJECTIVE_UNSPECIFIED, planner_pb2.OBJECTIVE_COST, planner_pb2.OBJECTIVE_LATENCY):
        inputs = planner_pb2.PlanInputs(model_preset="llama3-8b", topology_preset="h100-80g-8x", dtypes=[FP16],
                                        avg_context_tokens=512, objective=objective)
        chosen = stub.Plan(planner_pb2.PlanRequest(inputs=inputs), timeout=30).chosen
        picks[objective] = (chosen.tp, chosen.pp)
    assert picks == {planner_pb2.OBJECTIVE_UNSPECIFIED: (4, 1), planner_pb2.OBJECTIVE_COST: (2, 1),
                     planner_pb2.OBJECTIVE_LATENCY: (8, 1)}


def test_explain_lists_every_candidate_with_its_reason(stub: planner_pb2_grpc.PlannerServiceStub) -> None:
    response = stub.Explain(planner_pb2.ExplainRequest(inputs=llama70()), timeout=30)
    candidates = list(response.candidates)
    # TP ∈ {1, 2, 4, 8} (the NVLink domain), PP from 1 to 8 // TP on one node: 8 + 4 + 2 + 1 layouts,
    # plus TP16/32/64 (divisors of 64 heads) which exceed the node's 8 GPUs.
    labels = {(c.tp, c.pp) for c in candidates}
    assert {(1, p) for p in range(1, 9)} | {(2, p) for p in range(1, 5)} | {(4, 1), (4, 2), (8, 1)} <= labels
    assert sum(c.chosen for c in candidates) == 1 and candidates[0].chosen
    assert response.chosen == candidates[0]
    for c in candidates:
        assert c.verdict, (c.tp, c.pp)
        if c.feasible:
            assert not c.rejected_reason and c.shortfall_bytes == 0
        else:
            assert c.verdict == f"rejected: {c.rejected_reason}"
    # Feasible first, then the rejected ones closest to fitting first.
    feasible = [c.feasible for c in candidates]
    assert feasible == sorted(feasible, reverse=True)
    tp2 = next(c for c in candidates if (c.tp, c.pp) == (2, 1))
    assert not tp2.feasible and tp2.shortfall_bytes > 0
    assert f"short by {tp2.shortfall_bytes:,} B" in tp2.rejected_reason
    tp4pp2 = next(c for c in candidates if (c.tp, c.pp) == (4, 2))
    assert (tp4pp2.kv_tokens_per_gpu, tp4pp2.max_concurrent_sequences) == (524_288, 256)


def test_explain_of_an_infeasible_request_has_no_choice_but_every_reason(
        stub: planner_pb2_grpc.PlannerServiceStub) -> None:
    inputs = planner_pb2.PlanInputs(model_preset="llama3.1-405b", topology_preset="a100-80g-8x", dtypes=[FP16])
    response = stub.Explain(planner_pb2.ExplainRequest(inputs=inputs), timeout=30)
    assert not response.HasField("chosen")
    assert response.candidates and not any(c.feasible for c in response.candidates)
    assert all(c.rejected_reason for c in response.candidates)


def test_capacity_gives_12_replicas(stub: planner_pb2_grpc.PlannerServiceStub) -> None:
    request = planner_pb2.CapacityRequest(inputs=llama70(tp=4, pp=2), requests_per_s=400, output_tokens=300,
                                          seq_tokens_per_s=40)
    response = stub.Capacity(request, timeout=30)
    assert (response.plan.tp, response.plan.pp, response.plan.max_concurrent_sequences) == (4, 2, 256)
    assert response.demand_tokens_per_s == 120_000
    assert response.tokens_per_s_per_replica == 10_240
    assert (response.replicas, response.nodes, response.gpus) == (12, 12, 96)
    auto = response.autoscaling
    assert (auto.min_replicas, auto.max_replicas, auto.scale_on) == (4, 24, "kv_cache_utilization_pct")
    assert (auto.scale_out_threshold, auto.scale_in_threshold) == (pytest.approx(0.80), pytest.approx(0.35))


def test_infeasible_request_is_failed_precondition_naming_the_closest_plan(
        stub: planner_pb2_grpc.PlannerServiceStub) -> None:
    inputs = planner_pb2.PlanInputs(model_preset="llama3.1-405b", topology_preset="a100-80g-8x", dtypes=[FP16])
    with pytest.raises(grpc.RpcError) as caught:
        stub.Plan(planner_pb2.PlanRequest(inputs=inputs), timeout=30)
    assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    details = caught.value.details()
    assert "no shard plan fits llama3.1-405b" in details
    assert "Closest: TP4/PP2 float16 (8 GPUs)" in details
    assert "short by 40,263,188,480 B (37.50 GiB) per GPU" in details
    with pytest.raises(grpc.RpcError) as caught:
        stub.Capacity(planner_pb2.CapacityRequest(inputs=inputs, requests_per_s=1, output_tokens=10), timeout=30)
    assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION


@pytest.mark.parametrize(
    ("inputs", "code", "message"),
    [
        (planner_pb2.PlanInputs(), grpc.StatusCode.INVALID_ARGUMENT, "set model_preset"),
        (planner_pb2.PlanInputs(model_preset="gpt-5"), grpc.StatusCode.NOT_FOUND, "unknown model preset 'gpt-5'"),
        (planner_pb2.PlanInputs(model_preset="llama3-8b", topology_preset="b200"), grpc.StatusCode.INVALID_ARGUMENT,
         "unknown topology preset 'b200'"),
        (planner_pb2.PlanInputs(model_preset="llama3-8b", tp=3), grpc.StatusCode.INVALID_ARGUMENT,
         "tp 3 does not divide the 32 attention heads"),
        (planner_pb2.PlanInputs(model_config_json="{not json"), grpc.StatusCode.INVALID_ARGUMENT, "not valid JSON"),
        (planner_pb2.PlanInputs(model_config_json='{"hidden_size": 64}'), grpc.StatusCode.INVALID_ARGUMENT,
         "config.json is missing num_hidden_layers"),
        (planner_pb2.PlanInputs(model_preset="tiny", topology_spec=planner_pb2.Topology(gpus_per_node=0)),
         grpc.StatusCode.INVALID_ARGUMENT, "gpus_per_node must be a positive integer, got 0"),
        (planner_pb2.PlanInputs(model_preset="tiny", dtypes=[common_pb2.DTYPE_UNSPECIFIED]),
         grpc.StatusCode.INVALID_ARGUMENT, "inputs.dtypes: expected a dtype"),
    ],
)
def test_bad_inputs_get_the_right_status(stub: planner_pb2_grpc.PlannerServiceStub, inputs, code, message) -> None:
    with pytest.raises(grpc.RpcError) as caught:
        stub.Plan(planner_pb2.PlanRequest(inputs=inputs), timeout=30)
    assert caught.value.code() == code
    assert message in caught.value.details()


def test_plan_of_a_config_json_on_a_spelled_out_topology(stub: planner_pb2_grpc.PlannerServiceStub) -> None:
    """The proto's Topology carries latencies in ns; a CPU host's figures come through intact."""
    config = {"num_hidden_layers": 30, "hidden_size": 576, "num_attention_heads": 9, "num_key_value_heads": 3,
              "head_dim": 64, "intermediate_size": 1536, "vocab_size": 49152, "tie_word_embeddings": True}
    host = planner_pb2.Topology(
        name="host", gpus_per_node=3, gpu_memory_bytes=8 * GIB, nvlink_domain_size=3,
        intra_node_bandwidth_bytes_per_s=1e9, intra_node_latency_ns=100_000,
        inter_node_bandwidth_bytes_per_s=1e9, inter_node_latency_ns=100_000, hbm_bandwidth_bytes_per_s=10e9,
        peak_flops=100e9, peak_flops_fp32=50e9, usd_per_gpu_hour=0.04, reserve_bytes_per_gpu=GIB, device="cpu",
        step_overhead_ns=1_000_000, layer_overhead_ns=200_000, control_latency_ns=300_000,
        node_memory_bandwidth_bytes_per_s=20e9)
    inputs = planner_pb2.PlanInputs(model_config_json=json.dumps(config), topology_spec=host,
                                    dtypes=[common_pb2.DTYPE_FLOAT32], kv_cache_cap_bytes_per_gpu=GIB // 4,
                                    avg_context_tokens=256, tp=3, pp=1)
    chosen = stub.Plan(planner_pb2.PlanRequest(inputs=inputs), timeout=30).chosen
    assert (chosen.tp, chosen.pp, chosen.feasible) == (3, 1, True)
    # 61 all-reduces (2 per layer + the embedding's) at 2(n−1)·α = 400 µs each dominate; 3 ranks
    # busy at once on a host whose node bandwidth is 2× one rank's: contention 1.5.
    assert chosen.all_reduce_decode_us == pytest.approx(400 + 4 / 3 * 576 * 4 / 1e9 * 1e6, rel=1e-6)
    assert chosen.predicted_tpot_ms > 61 * 0.4 + 1.5 * (30 * 0.2 + 1.0) + 2 * 0.3


def test_a_spelled_out_topology_carries_its_int8_peak() -> None:
    """peak_flops_int8 (a calibrated CPU host's W8A8 matmul) reaches the cost model; 0 means the
    16-bit peak."""
    host = planner_pb2.Topology(
        name="host", gpus_per_node=2, gpu_memory_bytes=8 * GIB, nvlink_domain_size=2,
        intra_node_bandwidth_bytes_per_s=1e9, inter_node_bandwidth_bytes_per_s=1e9, hbm_bandwidth_bytes_per_s=10e9,
        peak_flops=100e9, usd_per_gpu_hour=0.04, device="cpu")
    plain = planner_server.topology_from_pb(planner_pb2.PlanInputs(topology_spec=host))
    assert plain.peak_dense_flops_int8 is None and plain.peak_flops("int8") == 100e9
    host.peak_flops_int8 = 180e9
    topology = planner_server.topology_from_pb(planner_pb2.PlanInputs(topology_spec=host))
    assert topology.peak_flops("int8") == 180e9 and topology.peak_flops("16bit") == 100e9


# ---- RecordPlan -------------------------------------------------------------------------------


@pytest.fixture
def pg_registry_url(postgres_url: str) -> Iterator[str]:
    """A fresh, empty PostgreSQL database: the planner migrates it on first use."""
    with fresh_database(postgres_url, "planner") as url:
        yield url


def test_record_plan_creates_a_provisioning_group_in_postgres(pg_registry_url: str) -> None:
    running = serve(pg_registry_url)
    try:
        with grpc.insecure_channel(running.address) as channel:
            stub = planner_pb2_grpc.PlannerServiceStub(channel)
            chosen = stub.Plan(planner_pb2.PlanRequest(inputs=llama70()), timeout=30).chosen
            layout = common_pb2.ShardLayout(tp_degree=chosen.tp, pp_degree=chosen.pp, dtype=chosen.dtype)
            response = stub.RecordPlan(planner_pb2.RecordPlanRequest(
                model_name="llama3-70b", layout=layout, kv_cache_cap_bytes=20 * GIB, name="llama3-70b-fp16-primary"),
                timeout=60)
            assert response.status == common_pb2.REPLICA_GROUP_STATUS_PROVISIONING

            given = str(uuid.uuid4())
            again = stub.RecordPlan(planner_pb2.RecordPlanRequest(
                model_name="llama3-70b", layout=layout, replica_group_id=given), timeout=30)
            assert again.replica_group_id == given
            with pytest.raises(grpc.RpcError) as caught:  # a group id is never reused
                stub.RecordPlan(planner_pb2.RecordPlanRequest(
                    model_name="llama3-70b", layout=layout, replica_group_id=given), timeout=30)
            assert caught.value.code() == grpc.StatusCode.ALREADY_EXISTS
            assert given in caught.value.details()
    finally:
        running.stop(0)

    with ShardRegistry(pg_registry_url) as registry:
        group = registry.get_group(response.replica_group_id)
        assert (group.model_name, group.tp_degree, group.pp_degree, group.dtype) == (
            "llama3-70b", chosen.tp, chosen.pp, "fp16")
        assert (group.status, group.kv_cache_cap_bytes, group.name) == (
            "provisioning", 20 * GIB, "llama3-70b-fp16-primary")
        defaulted = registry.get_group(given)
        assert defaulted.kv_cache_cap_bytes == 20 * GIB and defaulted.name is None
        assert [g.replica_group_id for g in registry.list_groups(status="provisioning")] == [
            group.replica_group_id, defaulted.replica_group_id]


@pytest.mark.parametrize(
    ("request_fields", "message"),
    [
        (dict(model_name="", layout=common_pb2.ShardLayout(tp_degree=1, pp_degree=1, dtype=FP16)),
         "model_name must not be empty"),
        (dict(model_name="llama3-70b", layout=common_pb2.ShardLayout(tp_degree=3, pp_degree=1, dtype=FP16)),
         "tp 3 does not divide the 64 attention heads"),
        (dict(model_name="m", layout=common_pb2.ShardLayout(tp_degree=0, pp_degree=1, dtype=FP16)),
         "tp must be a positive integer, got 0"),
        (dict(model_name="m", layout=common_pb2.ShardLayout(tp_degree=1, pp_degree=1)),
         "layout.dtype: expected a dtype"),
        (dict(model_name="m", layout=common_pb2.ShardLayout(tp_degree=1, pp_degree=1, dtype=FP16),
              replica_group_id="rg-1"), "replica_group_id must be a UUID, got 'rg-1'"),
    ],
)
def test_record_plan_rejects_bad_fields(stub: planner_pb2_grpc.PlannerServiceStub, sqlite_url: str,
                                        request_fields: dict, message: str) -> None:
    with pytest.raises(grpc.RpcError) as caught:
        stub.RecordPlan(planner_pb2.RecordPlanRequest(**request_fields), timeout=30)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in caught.value.details()
    if Path(make_url(sqlite_url).database).exists():  # nothing was recorded
        with ShardRegistry(sqlite_url) as registry:
            assert registry.list_groups() == []


def test_record_plan_to_the_embedded_default(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """No --registry-url and no SHARDLINE_REGISTRY_URL: the SQLite file under SHARDLINE_STATE_DIR."""
    monkeypatch.delenv("SHARDLINE_REGISTRY_URL", raising=False)
    monkeypatch.setenv("SHARDLINE_STATE_DIR", str(tmp_path / "state"))
    running = start_server(ServerConfig(service="planner", port=0),
                           planner_server.bindings(argparse.Namespace(registry_url=None)))
    try:
        with grpc.insecure_channel(running.address) as channel:
            layout = common_pb2.ShardLayout(tp_degree=1, pp_degree=1, dtype=common_pb2.DTYPE_FLOAT32)
            response = planner_pb2_grpc.PlannerServiceStub(channel).RecordPlan(
                planner_pb2.RecordPlanRequest(model_name="smollm2-135m", layout=layout, kv_cache_cap_bytes=GIB),
                timeout=60)
    finally:
        running.stop(0)
    with ShardRegistry(f"sqlite:///{tmp_path / 'state' / 'registry.db'}") as registry:
        group = registry.get_group(response.replica_group_id)
    assert (group.model_name, group.dtype, group.status) == ("smollm2-135m", "fp32", "provisioning")
