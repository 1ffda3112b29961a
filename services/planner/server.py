"""PlannerService: shard plans, their explanation and capacity sizing over gRPC.

A thin servicer: protobuf in (``*_from_pb``), a call into the planner's domain modules, protobuf
out (``*_to_pb``); domain errors become statuses in ``services.common.grpc_server`` (a request
that fits nowhere is FAILED_PRECONDITION naming the closest plan and its shortfall, a bad field
INVALID_ARGUMENT, an unknown model preset NOT_FOUND).

Units: the proto carries latencies in ns and TPOT in ms; the domain works in seconds.
"""

from __future__ import annotations

import argparse
import json
import math

import grpc

from services.common.config import resolve
from services.common.errors import InvalidArgument
from services.common.grpc_server import ServiceBinding, serve_service
from services.common.proto import common_pb2, planner_pb2, planner_pb2_grpc
from services.common.proto_convert import DTYPE_FROM_PB, DTYPE_TO_PB
from services.planner import render
from services.planner.capacity import Demand, plan_capacity
from services.planner.cost_model import Candidate, Workload
from services.planner.record import PlanRecorder
from services.planner.search import Assessment, PlanRequest, explain, search
from services.planner.specs import DTYPES, ModelSpec, UnknownModelError
from services.planner.specs import PRESETS as MODEL_PRESETS
from services.planner.topology import GIB, Topology, TopologyError, load_topology
from services.planner.topology import PRESETS as TOPOLOGY_PRESETS

SERVICE = "planner"
DEFAULT_TOPOLOGY = "a100-80g-8x"  # the CLI's default
DEFAULT_RESERVE_BYTES = 3 * GIB

OBJECTIVES: dict[int, str] = {
    planner_pb2.OBJECTIVE_UNSPECIFIED: "balanced",
    planner_pb2.OBJECTIVE_BALANCED: "balanced",
    planner_pb2.OBJECTIVE_COST: "cost",
    planner_pb2.OBJECTIVE_LATENCY: "latency",
}


# ---- protobuf in ---------------------------------------------------------------------------


def dtype_from_pb(value: int, field: str) -> str:
    name = DTYPE_FROM_PB.get(value)
    if name is None:
        raise InvalidArgument(f"{field}: expected a dtype (DTYPE_FLOAT32 … DTYPE_FP8), got {value}")
    return name


def model_from_pb(inputs: planner_pb2.PlanInputs) -> ModelSpec:
    which = inputs.WhichOneof("model")
    if which == "model_preset":
        if inputs.model_preset not in MODEL_PRESETS:  # never a path on the server's disk
            raise UnknownModelError(f"unknown model preset {inputs.model_preset!r}: expected one of "
                                    f"{', '.join(MODEL_PRESETS)}, or send model_config_json")
        return MODEL_PRESETS[inputs.model_preset]
    if which == "model_config_json":
        try:
            config = json.loads(inputs.model_config_json)
        except json.JSONDecodeError as exc:
            raise InvalidArgument(f"model_config_json is not valid JSON: {exc}") from exc
        if not isinstance(config, dict):
            raise InvalidArgument("model_config_json must be a JSON object (an HF config.json)")
        return ModelSpec.from_hf_config(config)
    raise InvalidArgument(f"inputs: set model_preset ({', '.join(MODEL_PRESETS)}) or model_config_json")


def topology_from_pb(inputs: planner_pb2.PlanInputs) -> Topology:
    which = inputs.WhichOneof("topology")
    if which is None:
        return TOPOLOGY_PRESETS[DEFAULT_TOPOLOGY]
    if which == "topology_preset":
        if inputs.topology_preset not in TOPOLOGY_PRESETS:  # never a path on the server's disk
            raise TopologyError(f"unknown topology preset {inputs.topology_preset!r}: expected one of "
                                f"{', '.join(TOPOLOGY_PRESETS)}, or give topology_spec")
        return load_topology(inputs.topology_preset)
    pb = inputs.topology_spec
    return Topology(
        name=pb.name or "custom",
        gpus_per_node=pb.gpus_per_node,
        gpu_memory_bytes=pb.gpu_memory_bytes,
        nvlink_domain_size=pb.nvlink_domain_size,
        intra_node_bandwidth_bytes_per_s=pb.intra_node_bandwidth_bytes_per_s,
        intra_node_latency_s=pb.intra_node_latency_ns * 1e-9,
        inter_node_bandwidth_bytes_per_s=pb.inter_node_bandwidth_bytes_per_s,
        inter_node_latency_s=pb.inter_node_latency_ns * 1e-9,
        hbm_bandwidth_bytes_per_s=pb.hbm_bandwidth_bytes_per_s,
        peak_dense_flops=pb.peak_flops,
        peak_dense_flops_fp32=pb.peak_flops_fp32 or pb.peak_flops,
        usd_per_gpu_hour=pb.usd_per_gpu_hour,
        reserve_bytes=pb.reserve_bytes_per_gpu or DEFAULT_RESERVE_BYTES,
        device=pb.device or "gpu",
        step_overhead_s=pb.step_overhead_ns * 1e-9,
        layer_overhead_s=pb.layer_overhead_ns * 1e-9,
        control_latency_s=pb.control_latency_ns * 1e-9,
        node_memory_bandwidth_bytes_per_s=(pb.node_memory_bandwidth_bytes_per_s
                                           if pb.HasField("node_memory_bandwidth_bytes_per_s") else None),
        peak_dense_flops_int8=pb.peak_flops_int8 or None,
    )


def plan_request_from_pb(inputs: planner_pb2.PlanInputs, *, seq_tokens_per_s: float | None = None) -> PlanRequest:
    """PlanInputs → the search's request; proto zeros mean the documented defaults."""
    dtypes = tuple(dtype_from_pb(d, "inputs.dtypes") for d in inputs.dtypes) or tuple(DTYPES)
    objective = OBJECTIVES.get(inputs.objective)
    if objective is None:
        raise InvalidArgument(f"inputs.objective: unknown value {inputs.objective}")
    workload = Workload(
        kv_cap_bytes=inputs.kv_cache_cap_bytes_per_gpu or 20 * GIB,
        avg_context=inputs.avg_context_tokens or 2048,
        concurrency=inputs.concurrency if inputs.HasField("concurrency") else None,
        seq_tokens_per_s=seq_tokens_per_s,
    )
    return PlanRequest(
        model=model_from_pb(inputs),
        topology=topology_from_pb(inputs),
        dtypes=dtypes,
        workload=workload,
        objective=objective,
        max_nodes=inputs.max_nodes or 1,
        allow_cross_node_tp=inputs.allow_cross_node_tp,
        tp=inputs.tp if inputs.HasField("tp") else None,
        pp=inputs.pp if inputs.HasField("pp") else None,
    )


# ---- protobuf out --------------------------------------------------------------------------


def _finite(x: float | None, scale: float = 1.0) -> float:
    """Proto doubles cannot be null: an undefined figure (no throughput, no price) is 0."""
    return x * scale if x is not None and math.isfinite(x) else 0.0


def model_to_pb(model: ModelSpec) -> planner_pb2.ModelSummary:
    return planner_pb2.ModelSummary(name=model.name, parameters=model.num_parameters, num_layers=model.num_layers,
                                    kv_bytes_per_token=model.kv_bytes_per_token("float16"))


def candidate_to_pb(a: Assessment) -> planner_pb2.Candidate:
    c, e = a.candidate, a.estimate
    pb = planner_pb2.Candidate(tp=c.tp, pp=c.pp, dtype=DTYPE_TO_PB[c.dtype], gpus=c.gpus, feasible=a.feasible,
                               rejected_reason=a.rejected_reason or "", verdict=a.verdict, chosen=a.chosen,
                               shortfall_bytes=a.shortfall_bytes or 0, blast_radius_gpus=c.gpus)
    if e is None:  # the layout cannot shard this model at all: no figures
        return pb
    pb.weight_bytes_per_gpu = e.weight_bytes_per_gpu
    pb.kv_bytes_per_token_per_gpu = e.kv_bytes_per_token_per_gpu
    pb.kv_tokens_per_gpu = e.kv_tokens_per_gpu
    pb.max_concurrent_sequences = e.max_concurrent_sequences
    pb.replicas_per_node = e.replicas_per_node
    pb.predicted_tpot_ms = _finite(e.tpot_batch1_s, 1e3)
    pb.tokens_per_s_per_replica = _finite(e.tokens_per_s_per_replica)
    pb.usd_per_million_tokens = _finite(e.usd_per_million_tokens)
    pb.gpu_hours_per_million_tokens = _finite(e.gpu_hours_per_million_tokens)
    pb.bubble_fraction = e.bubble_fraction
    pb.blast_radius_gpus = e.blast_radius_gpus
    pb.weight_read_ms = _finite(e.weight_read_s, 1e3)
    pb.all_reduce_decode_us = _finite(e.all_reduce_decode_s, 1e6)
    return pb


# ---- the service ---------------------------------------------------------------------------


class PlannerServicer(planner_pb2_grpc.PlannerServiceServicer):
    """gRPC face of the planner. ``recorder`` writes chosen plans to the shard registry."""

    def __init__(self, recorder: PlanRecorder) -> None:
        self.recorder = recorder

    def Plan(self, request: planner_pb2.PlanRequest, context: grpc.ServicerContext) -> planner_pb2.PlanResponse:
        plan_request = plan_request_from_pb(request.inputs)
        result = search(plan_request)
        return planner_pb2.PlanResponse(
            model=model_to_pb(plan_request.model),
            chosen=candidate_to_pb(result.chosen),
            explanation=result.chosen.verdict,
            shard_plan_yaml=render.shard_plan_yaml(plan_request, result.chosen),
        )

    def Explain(
        self, request: planner_pb2.ExplainRequest, context: grpc.ServicerContext
    ) -> planner_pb2.ExplainResponse:
        plan_request = plan_request_from_pb(request.inputs)
        chosen, assessments = explain(plan_request)
        return planner_pb2.ExplainResponse(
            model=model_to_pb(plan_request.model),
            chosen=candidate_to_pb(chosen) if chosen is not None else None,
            candidates=[candidate_to_pb(a) for a in assessments],
        )

    def Capacity(
        self, request: planner_pb2.CapacityRequest, context: grpc.ServicerContext
    ) -> planner_pb2.CapacityResponse:
        seq_rate = request.seq_tokens_per_s if request.HasField("seq_tokens_per_s") else None
        plan_request = plan_request_from_pb(request.inputs, seq_tokens_per_s=seq_rate)
        demand = Demand(
            req_per_s=request.requests_per_s,
            output_tokens=request.output_tokens,
            tpot_target_s=request.tpot_target_ms / 1e3 if request.HasField("tpot_target_ms") else None,
        )
        chosen = search(plan_request).chosen
        cap = plan_capacity(plan_request.model, plan_request.topology, chosen.candidate, plan_request.workload, demand)
        policy = cap.autoscaling
        return planner_pb2.CapacityResponse(
            plan=candidate_to_pb(chosen),
            demand_tokens_per_s=demand.output_tokens_per_s,
            tokens_per_s_per_replica=cap.tokens_per_s_per_replica,
            replicas=cap.replicas,
            nodes=cap.nodes,
            gpus=cap.gpus,
            autoscaling=planner_pb2.Autoscaling(
                min_replicas=policy.min_replicas,
                max_replicas=policy.max_replicas,
                scale_on=policy.scale_on,
                scale_out_threshold=policy.scale_out_threshold / 100,
                scale_in_threshold=policy.scale_in_threshold / 100,
            ),
        )

    def RecordPlan(
        self, request: planner_pb2.RecordPlanRequest, context: grpc.ServicerContext
    ) -> planner_pb2.RecordPlanResponse:
        layout = request.layout
        candidate = Candidate(layout.tp_degree, layout.pp_degree, dtype_from_pb(layout.dtype, "layout.dtype"))
        group = self.recorder.record(request.model_name, candidate, kv_cache_cap_bytes=request.kv_cache_cap_bytes,
                                     replica_group_id=request.replica_group_id, name=request.name)
        return planner_pb2.RecordPlanResponse(replica_group_id=str(group.replica_group_id),
                                              status=common_pb2.REPLICA_GROUP_STATUS_PROVISIONING)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Planner-specific flags (the common server flags are added by the caller)."""
    parser.add_argument("--registry-url", default=None,
                        help="shard registry for RecordPlan (postgresql+psycopg://... or sqlite:///PATH); env "
                             "SHARDLINE_REGISTRY_URL, default sqlite:///$SHARDLINE_STATE_DIR/registry.db")


def bindings(args: argparse.Namespace) -> list[ServiceBinding]:
    recorder = PlanRecorder(resolve("registry_url", getattr(args, "registry_url", None), "") or None)
    return [
        ServiceBinding(
            full_name=planner_pb2.DESCRIPTOR.services_by_name["PlannerService"].full_name,
            servicer=PlannerServicer(recorder),
            add_to_server=planner_pb2_grpc.add_PlannerServiceServicer_to_server,
        )
    ]


def serve(args: argparse.Namespace) -> int:
    return serve_service(args, service=SERVICE, bindings=lambda: bindings(args))
