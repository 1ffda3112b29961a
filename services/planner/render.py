"""Plan and capacity output: a table that explains itself, a shard-plan.yaml deploy config, or JSON.

JSON (one object): ``model`` (with ``parameters`` and unsharded ``kv_bytes_per_token``),
``topology``, ``request``, ``objective``, ``chosen`` and ``candidates`` (every candidate, each with
``tp``, ``pp``, ``dtype``, ``gpus``, ``feasible``, ``rejected_reason``, ``weight_bytes_per_gpu``,
``kv_bytes_per_token_per_gpu``, ``kv_tokens_per_gpu``, ``max_concurrent_sequences``,
``replicas_per_node``, ``predicted_tpot_ms``, ``tokens_per_s_per_replica``,
``usd_per_million_tokens``, ``bubble_fraction`` and more).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict
from typing import Any

import yaml

from services.common.numerics import PER_LAYOUT, numerics_for
from services.modeling.parallel.placement import placement, tp_split_across_nodes
from services.planner.capacity import AutoscalingPolicy, CapacityPlan
from services.planner.cost_model import Candidate, CostEstimate, Workload
from services.planner.search import Assessment, PlanRequest, PlanResult, explanation_order
from services.planner.specs import DTYPES, ModelSpec, get_dtype
from services.planner.topology import GIB, Topology

FORMATS = ("table", "yaml", "json")
SHARD_PREFIX = "model-tp{tp_rank:02d}-pp{pp_stage:02d}.safetensors"


def _finite(x: float | None, digits: int = 6) -> float | None:
    if x is None or not math.isfinite(x):
        return None
    return round(x, digits)


# --------------------------------------------------------------------------------------------
# dicts


def model_dict(model: ModelSpec, dtype: str) -> dict[str, Any]:
    return {
        "name": model.name,
        "parameters": model.num_parameters,
        "kv_bytes_per_token": model.kv_bytes_per_token(dtype),
        "kv_dtype_bytes": get_dtype(dtype).activation_bytes,
        "weight_bytes": model.weight_bytes(dtype),
        "weight_bytes_by_dtype": {d: model.weight_bytes(d) for d in DTYPES},
        "shape": model.to_dict(),
    }


def estimate_dict(est: CostEstimate) -> dict[str, Any]:
    return {
        "stage_layers": [s.layers for s in est.stages],
        "weight_bytes_per_gpu": est.weight_bytes_per_gpu,
        "kv_heads_per_rank": est.kv_heads_per_rank,
        "kv_replication": est.kv_replication,
        "kv_bytes_per_token_per_gpu": est.kv_bytes_per_token_per_gpu,
        "memory_needed_bytes": est.memory_needed_bytes,
        "memory_left_bytes": est.memory_left_bytes,
        "kv_tokens_per_gpu": est.kv_tokens_per_gpu,
        "max_concurrent_sequences": est.max_concurrent_sequences,
        "replicas_per_node": est.replicas_per_node,
        "nodes_per_replica": est.nodes_per_replica,
        "tp_link": est.tp_link,
        "all_reduce_decode_us": _finite(est.all_reduce_decode_s * 1e6, 4),
        "send_recv_decode_us": _finite(est.send_recv_decode_s * 1e6, 4),
        "weight_read_ms": _finite(est.weight_read_s * 1e3, 4),
        "predicted_tpot_ms": _finite(est.tpot_batch1_s * 1e3, 4),
        "concurrency": est.concurrency,
        "micro_batches": est.micro_batches,
        "predicted_tpot_ms_at_concurrency": _finite(est.tpot_at_concurrency_s * 1e3, 4),
        "bubble_fraction": _finite(est.bubble_fraction, 6),
        "seq_tokens_per_s": _finite(est.seq_tokens_per_s, 4),
        "tokens_per_s_per_replica": _finite(est.tokens_per_s_per_replica, 3),
        "gpu_hours_per_million_tokens": _finite(est.gpu_hours_per_million_tokens, 6),
        "usd_per_million_tokens": _finite(est.usd_per_million_tokens, 6),
        "blast_radius_gpus": est.blast_radius_gpus,
    }


_ESTIMATE_KEYS: tuple[str, ...] = (
    "stage_layers", "weight_bytes_per_gpu", "kv_heads_per_rank", "kv_replication",
    "kv_bytes_per_token_per_gpu", "memory_needed_bytes", "memory_left_bytes", "kv_tokens_per_gpu",
    "max_concurrent_sequences", "replicas_per_node", "nodes_per_replica", "tp_link",
    "all_reduce_decode_us", "send_recv_decode_us", "weight_read_ms", "predicted_tpot_ms", "concurrency",
    "micro_batches", "predicted_tpot_ms_at_concurrency", "bubble_fraction", "seq_tokens_per_s",
    "tokens_per_s_per_replica", "gpu_hours_per_million_tokens", "usd_per_million_tokens", "blast_radius_gpus",
)


def assessment_dict(a: Assessment) -> dict[str, Any]:
    c = a.candidate
    out: dict[str, Any] = {
        "tp": c.tp,
        "pp": c.pp,
        "dtype": c.dtype,
        "gpus": c.gpus,
        "feasible": a.feasible,
        "chosen": a.chosen,
        "rejected_reason": a.rejected_reason,
        "shortfall_bytes": a.shortfall_bytes,
        "verdict": a.verdict,
    }
    if a.estimate is not None:
        out.update(estimate_dict(a.estimate))
    else:
        out.update(dict.fromkeys(_ESTIMATE_KEYS))
    return out


def workload_dict(w: Workload) -> dict[str, Any]:
    return asdict(w)


def request_dict(r: PlanRequest) -> dict[str, Any]:
    return {
        "dtypes": list(r.dtypes),
        "objective": r.objective,
        "max_nodes": r.max_nodes,
        "allow_cross_node_tp": r.allow_cross_node_tp,
        "tp": r.tp,
        "pp": r.pp,
        "latency_band": r.latency_band,
        "cost_tie_tolerance": r.cost_tie_tolerance,
        **workload_dict(r.workload),
    }


def plan_dict(result: PlanResult) -> dict[str, Any]:
    r = result.request
    return {
        "model": model_dict(r.model, result.chosen.candidate.dtype),
        "topology": r.topology.to_dict(),
        "request": request_dict(r),
        "objective": r.objective,
        "chosen": assessment_dict(result.chosen),
        "candidates": [assessment_dict(a) for a in result.assessments],
    }


def capacity_dict(cap: CapacityPlan, model: ModelSpec, topology: Topology, workload: Workload) -> dict[str, Any]:
    c = cap.estimate.candidate
    return {
        "model": model_dict(model, c.dtype),
        "topology": topology.to_dict(),
        "workload": workload_dict(workload),
        "plan": {"tp": c.tp, "pp": c.pp, "dtype": c.dtype, "gpus": c.gpus, **estimate_dict(cap.estimate)},
        "demand": {
            "req_per_s": cap.demand.req_per_s,
            "output_tokens": cap.demand.output_tokens,
            "output_tokens_per_s": cap.demand.output_tokens_per_s,
            "tpot_target_ms": None if cap.demand.tpot_target_s is None else cap.demand.tpot_target_s * 1e3,
        },
        "concurrency_per_replica": cap.concurrency_per_replica,
        "tpot_ms": _finite(cap.tpot_s * 1e3, 4),
        "seq_tokens_per_s": _finite(cap.seq_tokens_per_s, 4),
        "seq_rate_source": cap.seq_rate_source,
        "tokens_per_s_per_replica": _finite(cap.tokens_per_s_per_replica, 3),
        "replicas_exact": _finite(cap.replicas_exact, 4),
        "replicas": cap.replicas,
        "replicas_below_scale_out": cap.replicas_below_scale_out,
        "nodes": cap.nodes,
        "gpus": cap.gpus,
        "autoscaling": autoscaling_dict(cap.autoscaling),
    }


def autoscaling_dict(policy: AutoscalingPolicy) -> dict[str, Any]:
    return asdict(policy)


# --------------------------------------------------------------------------------------------
# shard-plan.yaml


def shard_plan_dict(
    model: ModelSpec,
    topology: Topology,
    candidate: Candidate,
    est: CostEstimate,
    workload: Workload,
    autoscaling: AutoscalingPolicy,
    *,
    manifest_uri: str | None = None,
) -> dict[str, Any]:
    """A shard-plan.yaml deploy config: ``replica_group`` and ``autoscaling``, plus ``predicted``."""
    short = get_dtype(candidate.dtype).short_name
    spans_nodes = candidate.tp > topology.nvlink_domain_size or est.tp_link == "network"
    kv_cap_gb: float = workload.kv_cap_bytes / GIB
    return {
        "replica_group": {
            "name": f"{model.name}-{short}-primary",
            "tp_degree": candidate.tp,
            "pp_degree": candidate.pp,
            "dtype": candidate.dtype,
            "gpus_per_replica": candidate.gpus,
            # the same bits at every layout up to TP 8 (the default); a plan above must say per-layout
            **({"numerics": PER_LAYOUT} if numerics_for(candidate.tp) == PER_LAYOUT else {}),
            "nvlink_domain": "cross-node" if spans_nodes else "node-local",
            "kv_cache_cap_gb": int(kv_cap_gb) if kv_cap_gb.is_integer() else round(kv_cap_gb, 3),
            "max_concurrent_sequences": est.max_concurrent_sequences,
            "checkpoint": {
                "manifest_uri": manifest_uri or f"s3://models/{model.name}/{short}/manifest.json",
                "shard_prefix": SHARD_PREFIX,
            },
        },
        "autoscaling": autoscaling_dict(autoscaling),
        # which node runs which ranks: what `serve worker --nnodes` checks its launch against
        "placement": placement_dicts(candidate.tp, candidate.pp, topology.gpus_per_node),
        "predicted": {
            "topology": topology.name,
            "stage_layers": [s.layers for s in est.stages],
            "weight_bytes_per_gpu": est.weight_bytes_per_gpu,
            "kv_bytes_per_token_per_gpu": est.kv_bytes_per_token_per_gpu,
            "kv_tokens_per_gpu": est.kv_tokens_per_gpu,
            "tpot_ms": _finite(est.tpot_batch1_s * 1e3, 4),
            "tokens_per_s_per_replica": _finite(est.tokens_per_s_per_replica, 3),
            "usd_per_million_tokens": _finite(est.usd_per_million_tokens, 6),
        },
    }


def shard_plan_yaml(request: PlanRequest, chosen: Assessment, *, manifest_uri: str | None = None,
                    min_replicas: int | None = None, max_replicas: int | None = None) -> str:
    """The chosen plan as a shard-plan.yaml deploy config. Without a demand to size for, autoscaling
    spans one replica up to a node's worth (as `shardline plan --format yaml` writes it)."""
    est = chosen.estimate
    assert est is not None, "a chosen plan has an estimate"
    low = min_replicas or 1
    policy = AutoscalingPolicy(min_replicas=low, max_replicas=max(low, max_replicas or est.replicas_per_node or 1))
    data = shard_plan_dict(request.model, request.topology, chosen.candidate, est, request.workload, policy,
                           manifest_uri=manifest_uri)
    return to_yaml(data)


def to_yaml(data: dict[str, Any]) -> str:
    return yaml.safe_dump(data, sort_keys=False)


def to_json(data: dict[str, Any]) -> str:
    return json.dumps(data, indent=2)


# --------------------------------------------------------------------------------------------
# table


def _gib(n: float) -> str:
    return f"{n / GIB:.2f} GiB"


def _params(n: int) -> str:
    return f"{n / 1e9:.2f}e9" if n >= 1e9 else f"{n / 1e6:.2f}e6"


def _num(x: float | None, fmt: str) -> str:
    return "-" if x is None or not math.isfinite(x) else format(x, fmt)


def _row(a: Assessment) -> list[str]:
    c, e = a.candidate, a.estimate
    status = "chosen" if a.chosen else ("ok" if a.feasible else "rejected")
    if e is None:
        return [c.label, str(c.gpus), *["-"] * 10, status]
    if not a.feasible:
        # Only the memory figures mean anything for a plan that cannot run.
        memory = [_gib(e.weight_bytes_per_gpu), f"{e.kv_bytes_per_token_per_gpu:,}", f"{e.kv_tokens_per_gpu:,}"]
        return [c.label, str(c.gpus), *memory, *["-"] * 7, status]
    return [
        c.label,
        str(c.gpus),
        _gib(e.weight_bytes_per_gpu),
        f"{e.kv_bytes_per_token_per_gpu:,}",
        f"{e.kv_tokens_per_gpu:,}",
        str(e.max_concurrent_sequences),
        str(e.replicas_per_node),
        _num(e.tpot_batch1_s * 1e3, ".2f"),
        _num(e.tpot_at_concurrency_s * 1e3, ".2f"),
        _num(e.tokens_per_s_per_replica, ",.0f"),
        "-" if e.usd_per_million_tokens is None else f"${e.usd_per_million_tokens:.3f}",
        f"{e.bubble_fraction:.2f}",
        status,
    ]


_HEADER = ["plan", "gpus", "weights/GPU", "KV B/tok/GPU", "KV tok/GPU", "seqs", "rep/node",
           "TPOT b=1 ms", "TPOT@conc ms", "tok/s/replica", "$/M tok", "bubble", ""]


def _format_table(rows: list[list[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in [_HEADER, *rows]) for i in range(len(_HEADER))]
    lines = []
    for r in [_HEADER, *rows]:
        cells = [r[0].ljust(widths[0])] + [r[i].rjust(widths[i]) for i in range(1, len(r) - 1)] + [r[-1]]
        lines.append("  ".join(cells).rstrip())
    return lines


def _order(result: PlanResult) -> list[Assessment]:
    return explanation_order(result.assessments, result.request.objective)


def plan_table(result: PlanResult) -> str:
    r = result.request
    m, t, w = r.model, r.topology, r.workload
    chosen = result.chosen
    kv_dtype = chosen.candidate.dtype
    lines = [
        f"shardline plan · {m.name} on {t.name} · objective: {r.objective}",
        f"model     {_params(m.num_parameters)} parameters ({m.num_parameters:,}); {m.num_layers} layers, "
        f"hidden {m.hidden_size}, {m.num_attention_heads} heads / {m.num_key_value_heads} KV heads × "
        f"{m.head_dim}; KV {m.kv_bytes_per_token(kv_dtype):,} B/token unsharded ({kv_dtype})",
        f"topology  {r.max_nodes} node(s) × {t.gpus_per_node} GPUs × {_gib(t.gpu_memory_bytes)} "
        f"(reserve {_gib(t.reserve_bytes)}); NVLink {t.intra_node_bandwidth_bytes_per_s / 1e9:.4g} GB/s "
        f"α {t.intra_node_latency_s * 1e6:.3g} µs; network {t.inter_node_bandwidth_bytes_per_s / 1e9:.4g} GB/s "
        f"α {t.inter_node_latency_s * 1e6:.3g} µs; HBM {t.hbm_bandwidth_bytes_per_s / 1e9:.4g} GB/s; "
        f"${t.usd_per_gpu_hour:.2f}/GPU-h",
        f"workload  KV cap {_gib(w.kv_cap_bytes)}/GPU, avg context {w.avg_context:,} tokens, "
        + (f"concurrency {w.concurrency}" if w.concurrency else "concurrency = what the KV cap holds")
        + (f", {w.seq_tokens_per_s:g} tok/s per sequence (given)" if w.seq_tokens_per_s else ""),
    ]
    if t.step_overhead_s or t.layer_overhead_s or t.node_memory_bandwidth_bytes_per_s:
        lines.append(
            f"serving   {t.step_overhead_s * 1e3:.2f} ms per step + {t.layer_overhead_s * 1e6:.0f} µs per layer, "
            f"step broadcast {t.control_latency_s * 1e6:.0f} µs"
            + (f"; ranks share {t.node_memory_bandwidth_bytes_per_s / 1e9:.4g} GB/s per node (contention "
               f"{t.contention(t.gpus_per_node):.2f} with all {t.gpus_per_node} busy)"
               if t.node_memory_bandwidth_bytes_per_s else "")
        )
    lines.append("")
    ordered = _order(result)
    lines += _format_table([_row(a) for a in ordered])
    lines.append("")
    ce = chosen.estimate
    assert ce is not None
    lines.append(
        f"Chosen: {chosen.candidate.label} — {chosen.verdict.removeprefix('chosen: ')}. "
        + (
            f"TP all-reduce on {ce.tp_link}: {ce.all_reduce_decode_s * 1e6:.1f} µs per decode all-reduce, "
            f"{2 * m.num_layers} per token. "
            if chosen.candidate.tp > 1
            else "No TP all-reduce. "
        )
        + f"Blast radius {ce.blast_radius_gpus} GPU(s)."
    )
    lines += placement_lines(chosen.candidate.tp, chosen.candidate.pp, t.gpus_per_node)
    lines.append("Why the others lost:")
    for a in ordered:
        if not a.chosen:
            lines.append(f"  {a.candidate.label}: {a.verdict}")
    return "\n".join(lines) + "\n"


def placement_lines(tp: int, pp: int, gpus_per_node: int) -> list[str]:
    """``Placement:`` and one line per node: which ranks (stage and TP rank) each node runs."""
    nodes = placement(tp, pp, gpus_per_node)
    head = (f"Placement: {len(nodes)} node(s) of {gpus_per_node} GPUs, rank = pp_stage × {tp} + tp_rank"
            + ("; a TP group spans nodes" if tp_split_across_nodes(tp, pp, gpus_per_node) else "") + ":")
    return [head, *(f"  {n.describe(tp)}" for n in nodes)]


def placement_dicts(tp: int, pp: int, gpus_per_node: int) -> list[dict[str, Any]]:
    return [{"node": n.node, "ranks": list(n.ranks), "pp_stages": list(n.stages)}
            for n in placement(tp, pp, gpus_per_node)]


def capacity_table(cap: CapacityPlan, model: ModelSpec, topology: Topology) -> str:
    e, d = cap.estimate, cap.demand
    c = e.candidate
    lines = [
        f"shardline plan capacity · {model.name} {c.label} on {topology.name}",
        f"demand        {d.req_per_s:g} req/s × {d.output_tokens:,} output tokens = {d.output_tokens_per_s:,.0f} tok/s"
        + (f", TPOT target {d.tpot_target_s * 1e3:g} ms" if d.tpot_target_s else ""),
        f"per replica   {cap.concurrency_per_replica:,} sequences × {cap.seq_tokens_per_s:.2f} tok/s "
        f"(TPOT {cap.tpot_s * 1e3:.2f} ms, {cap.seq_rate_source}) = "
        f"{cap.tokens_per_s_per_replica:,.0f} tok/s",
        f"replicas      ⌈{cap.replicas_exact:.2f}⌉ = {cap.replicas} ({cap.replicas_below_scale_out} keep KV "
        f"utilization under {cap.autoscaling.scale_out_threshold}%)",
        f"fleet         {cap.nodes} node(s), {cap.gpus} GPUs ({e.replicas_per_node or 1 / e.nodes_per_replica:g} "
        "replica(s) per node)",
        f"autoscaling   min {cap.autoscaling.min_replicas}, max {cap.autoscaling.max_replicas}, on "
        f"{cap.autoscaling.scale_on}: out > {cap.autoscaling.scale_out_threshold}%, in < "
        f"{cap.autoscaling.scale_in_threshold}%",
    ]
    return "\n".join(lines) + "\n"


__all__ = [
    "FORMATS",
    "assessment_dict",
    "capacity_dict",
    "capacity_table",
    "model_dict",
    "plan_dict",
    "plan_table",
    "shard_plan_dict",
    "shard_plan_yaml",
    "to_json",
    "to_yaml",
]
