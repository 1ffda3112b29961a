"""`shardline plan`: choose TP, PP and dtype; size a fleet (`plan capacity`); measure a host
(`plan calibrate`).

    shardline plan [--model PRESET|DIR | --config config.json] [--topology PRESET|FILE]
                   [--gpu-memory-gb --gpus-per-node ...] [--dtype D|any] [--kv-cap-gb 20]
                   [--avg-context 2048] [--objective cost|latency|balanced] [--tp N --pp N]
                   [--format table|yaml|json]
    shardline plan capacity --model M --tp 4 --pp 2 --req-per-s R --output-tokens T
                   [--avg-context C] [--tpot-target MS] [--seq-tokens-per-s X] [--format ...]
    shardline plan calibrate --out topology.yaml [--world-size 2]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from services.planner import render
from services.planner.capacity import AutoscalingPolicy, Demand, plan_capacity
from services.planner.cost_model import Candidate, Workload
from services.planner.search import PlanRequest, search
from services.planner.specs import ModelSpec, SpecError, load_model_spec, parse_dtypes
from services.planner.topology import load_topology

GIB = 1024**3


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "plan",
        help="pick TP/PP/dtype for a replica group and explain every candidate",
        description="Pick a shard plan (TP degree, PP degree, dtype) by a stated objective and explain "
        "every candidate. Subcommands: capacity (size a fleet for a demand), calibrate (measure this host).",
    )
    _model_args(parser)
    _search_args(parser)
    parser.set_defaults(func=run_plan)
    sub = parser.add_subparsers(dest="plan_command", metavar="{capacity,calibrate}")

    cap = sub.add_parser("capacity", help="replicas and nodes for a demand, with the autoscaling block")
    _model_args(cap)
    _search_args(cap)
    cap.add_argument("--req-per-s", type=float, required=True, help="request arrival rate")
    cap.add_argument("--output-tokens", type=int, required=True, help="average output tokens per request")
    cap.add_argument("--tpot-target", type=float, default=None, metavar="MS",
                     help="per-token latency target; lowers concurrency per replica until it is met")
    cap.set_defaults(func=run_capacity)

    cal = sub.add_parser("calibrate", help="measure this host (collectives, memory, matmul) into a topology YAML")
    cal.add_argument("--out", type=Path, required=True, help="topology YAML to write")
    cal.add_argument("--world-size", type=int, default=2, help="local ranks to launch (default 2)")
    cal.add_argument("--backend", default=None, help="process-group backend (default: nccl with CUDA, else gloo)")
    cal.add_argument("--name", default=None, help="topology name (default: <host>-calibrated)")
    cal.add_argument("--usd-per-hour", type=float, default=None,
                     help="price per rank-hour to record (default: a cloud vCPU-hour, or $2.80 per GPU)")
    cal.add_argument("--ranks-per-node", type=int, default=None,
                     help="ranks this host offers the planner (default: usable cores, or CUDA devices)")
    cal.add_argument("--json", action="store_true", help="print the measurements as one JSON object")
    cal.set_defaults(func=run_calibrate)


def _model_args(p: argparse.ArgumentParser) -> None:
    src = p.add_argument_group("model and hardware")
    src.add_argument("--model", default=None, help="preset (llama3-70b, llama3-8b, llama3.1-405b, smollm2-135m, "
                     "tiny) or a model directory with config.json")
    src.add_argument("--config", default=None, help="a Hugging Face config.json")
    src.add_argument("--topology", default="a100-80g-8x",
                     help="preset (a100-80g-8x, h100-80g-8x, h200-141g-8x) or a topology YAML (default a100-80g-8x)")
    src.add_argument("--gpus-per-node", type=int, default=None)
    src.add_argument("--gpu-memory-gb", type=float, default=None, help="GPU memory in GiB")
    src.add_argument("--nvlink-domain-size", type=int, default=None)
    src.add_argument("--nvlink-gb-per-s", type=float, default=None, help="intra-node bus bandwidth, GB/s")
    src.add_argument("--nvlink-latency-us", type=float, default=None, help="intra-node per-hop latency, µs")
    src.add_argument("--network-gb-per-s", type=float, default=None, help="inter-node bandwidth per GPU, GB/s")
    src.add_argument("--network-latency-us", type=float, default=None, help="inter-node per-hop latency, µs")
    src.add_argument("--hbm-gb-per-s", type=float, default=None, help="memory bandwidth per GPU, GB/s")
    src.add_argument("--peak-tflops", type=float, default=None, help="16-bit dense TFLOP/s per GPU")
    src.add_argument("--usd-per-gpu-hour", type=float, default=None)
    src.add_argument("--reserve-gb", type=float, default=None, help="per-GPU reserve in GiB (default 3)")


def _search_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("plan")
    g.add_argument("--dtype", default="float16", help="float16|bfloat16|float32|int8|fp8 (aliases fp16, bf16, "
                   "fp32), a comma list, or 'any' (default float16)")
    g.add_argument("--kv-cap-gb", type=float, default=20.0, help="KV-cache cap per GPU in GiB (default 20)")
    g.add_argument("--avg-context", type=int, default=2048, help="average tokens per sequence (default 2048)")
    g.add_argument("--concurrency", type=int, default=None,
                   help="sequences decoding together (default: as many as the KV cap holds)")
    g.add_argument("--seq-tokens-per-s", type=float, default=None,
                   help="per-sequence decode rate to assume instead of the predicted 1/TPOT")
    g.add_argument("--objective", choices=("balanced", "cost", "latency"), default="balanced")
    g.add_argument("--latency-band", type=float, default=0.10,
                   help="balanced: TPOT tolerance over the best, as a fraction (default 0.10)")
    g.add_argument("--tp", type=int, default=None, help="fix the TP degree")
    g.add_argument("--pp", type=int, default=None, help="fix the PP degree")
    g.add_argument("--max-nodes", "--nodes", type=int, default=1, help="nodes one replica group may span (default 1)")
    g.add_argument("--allow-cross-node-tp", action="store_true", help="let a TP group leave the NVLink domain")
    g.add_argument("--min-replicas", type=int, default=None, help="autoscaling floor to write")
    g.add_argument("--max-replicas", type=int, default=None, help="autoscaling ceiling to write")
    g.add_argument("--manifest-uri", default=None, help="checkpoint manifest URI to write in the YAML")
    g.add_argument("--format", choices=("table", "yaml", "json"), default="table")


# --------------------------------------------------------------------------------------------


def _fail(what: str, exc: Exception) -> int:
    print(f"shardline {what}: error: {exc}", file=sys.stderr)
    return 1


def _load(args: argparse.Namespace):  # -> tuple[ModelSpec, Topology, Workload, tuple[str, ...]]

    if args.model and args.config:
        raise SpecError("give --model or --config, not both")
    if args.config:
        model = ModelSpec.from_config_file(args.config)
    elif args.model:
        model = load_model_spec(args.model)
    else:
        raise SpecError("a model is required: --model PRESET|DIR or --config config.json")

    def scaled(value: float | None, factor: float) -> float | None:
        return None if value is None else value * factor

    topology = load_topology(args.topology).with_overrides(
        gpus_per_node=args.gpus_per_node,
        gpu_memory_bytes=None if args.gpu_memory_gb is None else int(args.gpu_memory_gb * GIB),
        nvlink_domain_size=args.nvlink_domain_size,
        intra_node_bandwidth_bytes_per_s=scaled(args.nvlink_gb_per_s, 1e9),
        intra_node_latency_s=scaled(args.nvlink_latency_us, 1e-6),
        inter_node_bandwidth_bytes_per_s=scaled(args.network_gb_per_s, 1e9),
        inter_node_latency_s=scaled(args.network_latency_us, 1e-6),
        hbm_bandwidth_bytes_per_s=scaled(args.hbm_gb_per_s, 1e9),
        peak_dense_flops=scaled(args.peak_tflops, 1e12),
        usd_per_gpu_hour=args.usd_per_gpu_hour,
        reserve_bytes=None if args.reserve_gb is None else int(args.reserve_gb * GIB),
    )
    workload = Workload(
        kv_cap_bytes=int(args.kv_cap_gb * GIB),
        avg_context=args.avg_context,
        concurrency=args.concurrency,
        seq_tokens_per_s=args.seq_tokens_per_s,
    )
    return model, topology, workload, parse_dtypes(args.dtype)


def _request(args: argparse.Namespace):
    model, topology, workload, dtypes = _load(args)
    return PlanRequest(
        model=model,
        topology=topology,
        dtypes=dtypes,
        workload=workload,
        objective=args.objective,
        max_nodes=args.max_nodes,
        allow_cross_node_tp=args.allow_cross_node_tp,
        tp=args.tp,
        pp=args.pp,
        latency_band=args.latency_band,
    )


_ERRORS: tuple[type[Exception], ...] = (ValueError, OSError)


def run_plan(args: argparse.Namespace) -> int:
    try:
        request = _request(args)
        result = search(request)
    except _ERRORS as exc:
        return _fail("plan", exc)
    if args.format == "json":
        print(render.to_json(render.plan_dict(result)))
    elif args.format == "yaml":
        est = result.chosen.estimate
        assert est is not None
        low = args.min_replicas or 1
        policy = AutoscalingPolicy(min_replicas=low, max_replicas=max(low, args.max_replicas or est.replicas_per_node or 1))
        data = render.shard_plan_dict(request.model, request.topology, result.chosen.candidate, est,
                                      request.workload, policy, manifest_uri=args.manifest_uri)
        print(render.to_yaml(data), end="")
    else:
        print(render.plan_table(result), end="")
    return 0


def run_capacity(args: argparse.Namespace) -> int:
    try:
        request = _request(args)
        if args.tp is not None and args.pp is not None and len(request.dtypes) == 1:
            candidate = Candidate(args.tp, args.pp, request.dtypes[0])
        else:
            candidate = search(request).chosen.candidate
        demand = Demand(
            req_per_s=args.req_per_s,
            output_tokens=args.output_tokens,
            tpot_target_s=None if args.tpot_target is None else args.tpot_target / 1e3,
        )
        cap = plan_capacity(request.model, request.topology, candidate, request.workload, demand,
                            min_replicas=args.min_replicas, max_replicas=args.max_replicas)
    except _ERRORS as exc:
        return _fail("plan capacity", exc)
    if args.format == "json":
        print(render.to_json(render.capacity_dict(cap, request.model, request.topology, request.workload)))
    elif args.format == "yaml":
        data = render.shard_plan_dict(request.model, request.topology, candidate, cap.estimate, request.workload,
                                      cap.autoscaling, manifest_uri=args.manifest_uri)
        print(render.to_yaml(data), end="")
    else:
        print(render.capacity_table(cap, request.model, request.topology), end="")
    return 0


def run_calibrate(args: argparse.Namespace) -> int:
    # deferred: calibration runs ranks and the serving engine (torch); the planning commands don't
    from services.planner.calibrate import calibrate
    from services.worker.engine_timing import engine_decode_steps_s

    try:
        result = calibrate(args.out, engine_decode_steps=engine_decode_steps_s, world_size=args.world_size,
                           backend=args.backend, name=args.name,
                           usd_per_hour=args.usd_per_hour, ranks_per_node=args.ranks_per_node)
    except (ValueError, OSError, RuntimeError) as exc:
        return _fail("plan calibrate", exc)
    if args.json:
        print(json.dumps(result.as_json()))
    else:
        print(result.summary())
    return 0
