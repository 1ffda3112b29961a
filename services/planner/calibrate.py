"""Measure the machine we run on and write a topology the planner accepts.

`shardline plan calibrate --out topology.yaml [--world-size 2] [--ranks-per-node N]` launches
local ranks (torch.multiprocessing spawn; gloo on CPU, NCCL when CUDA is present) and measures
(see ``calibrate_ranks`` for how each figure is taken):

* all-reduce time for small (latency-bound) and large (bandwidth-bound) messages, fitted to the
  ring model by weighted least squares (weights 1/t², i.e. relative error, so the microsecond
  points pin α and the megabyte points pin B)::

      t(S) = a + b·S,   a = 2(n−1)·α,   b = 2(n−1)/(n·B)   →   α = a / 2(n−1),  B = 2(n−1) / (n·b)

  and a decode all-reduce *between weight reads*, every rank streaming weights in lock step as
  tensor parallelism does. On a host with fewer cores than ranks that costs more than an
  isolated all-reduce (the rank without a core holds everyone up), so the topology's α is the
  larger of the two (the isolated fit stays in the ``calibration`` block);

* send/recv one-way time (half a ping-pong) fitted to ``t(S) = α + S/B``, and the small
  broadcast the engine sends every step (``control_latency_s``);
* weight-streaming bandwidth of one rank alone (``hbm_bandwidth_bytes_per_s``) and of every rank
  at once (``node_memory_bandwidth_bytes_per_s``: their ratio is the host's contention);
* matmul throughput (2·n³ / seconds) for float32 and bfloat16;
* the serving engine's fixed costs, from its mean decode step on tiny random models of two depths
  (``layer_overhead_s`` = the slope per layer, ``step_overhead_s`` = the rest).

Calibrate at the world size you will run: each rank gets ``cores // world_size`` threads, as the
engine's ranks do, so 3 ranks on 2 cores measure an oversubscribed host. World size 1 is allowed
(one rank with every core; the links are then measured first, between two processes). On a CPU host
each rank stands in for a "GPU": ``gpus_per_node`` is ``--ranks-per-node`` (default: usable
cores, at least the world size), ``gpu_memory_bytes`` is host memory divided among them, the
NVLink domain is the whole host, and since there is no second node the inter-node link repeats
the loopback figures. The raw samples and fits are kept in the file under ``calibration`` (the
planner ignores that block).
"""

from __future__ import annotations

import json
import os
import socket
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

from services.common.ports import rendezvous_port
from services.modeling.tiny import TinyModelSpec, write_tiny_model
from services.planner.calibrate_ranks import RankArgs, rank_main, stream_bytes_for_host, summarize_ranks
from services.planner.specs import ModelSpec
from services.planner.topology import GIB, Topology

# The random models whose decode steps give the engine's fixed costs: two depths separate the
# per-layer from the per-step cost. Each layer streams a few MiB of weights (more than a core's
# private caches, as a real layer does: dispatch costs about twice as much with cold caches as
# with warm ones), small enough in all to stay in a server's last-level cache; the calibration
# subtracts their reads at the bandwidth that working set gets.
OVERHEAD_MODEL_LAYERS = (2, 10)
OVERHEAD_MODEL_SHAPE = {"hidden": 256, "heads": 4, "kv_heads": 2, "intermediate": 1024, "vocab": 512}
CPU_USD_PER_CORE_HOUR = 0.04  # roughly one cloud vCPU-hour
GPU_USD_PER_HOUR = 2.80


class CalibrationError(RuntimeError):
    """The measurement could not be taken or made no physical sense."""


@dataclass(frozen=True)
class LinearFit:
    """t(S) = intercept_s + slope_s_per_byte · S."""

    intercept_s: float
    slope_s_per_byte: float


def fit_linear(points: list[tuple[float, float]]) -> LinearFit:
    """Weighted least squares of t = a + b·S with weights 1/t² (minimises relative error).

    Normal equations for Σ wᵢ (tᵢ − a − b·Sᵢ)²:
        a·Σw   + b·ΣwS  = Σwt
        a·ΣwS  + b·ΣwS² = ΣwSt
    """
    if len(points) < 2:
        raise CalibrationError(f"need at least 2 samples to fit, got {len(points)}")
    sw = sws = swss = swt = swst = 0.0
    for size, t in points:
        if t <= 0:
            raise CalibrationError(f"non-positive time {t} for {size} bytes")
        w = 1.0 / (t * t)
        sw += w
        sws += w * size
        swss += w * size * size
        swt += w * t
        swst += w * size * t
    det = sw * swss - sws * sws
    if det <= 0:
        raise CalibrationError("message sizes do not vary; cannot separate latency from bandwidth")
    a = (swt * swss - sws * swst) / det
    b = (sw * swst - sws * swt) / det
    return LinearFit(a, b)


def ring_alpha_bandwidth(points: list[tuple[float, float]], num_ranks: int) -> tuple[float, float]:
    """(α seconds per hop, B bytes/s) of the ring all-reduce model fitted to (bytes, seconds)."""
    if num_ranks < 2:
        raise CalibrationError(f"an all-reduce fit needs ≥ 2 ranks, got {num_ranks}")
    fit = fit_linear(points)
    n = num_ranks
    if fit.slope_s_per_byte <= 0:
        raise CalibrationError(f"all-reduce time does not grow with size (slope {fit.slope_s_per_byte:g} s/B)")
    smallest = min(t for _, t in points)
    intercept = fit.intercept_s if fit.intercept_s > 0 else smallest  # a negative intercept is noise
    return intercept / (2 * (n - 1)), 2 * (n - 1) / (n * fit.slope_s_per_byte)


def p2p_alpha_bandwidth(points: list[tuple[float, float]]) -> tuple[float, float]:
    """(α, B) of t = α + S/B."""
    fit = fit_linear(points)
    if fit.slope_s_per_byte <= 0:
        raise CalibrationError(f"send/recv time does not grow with size (slope {fit.slope_s_per_byte:g} s/B)")
    smallest = min(t for _, t in points)
    return (fit.intercept_s if fit.intercept_s > 0 else smallest), 1.0 / fit.slope_s_per_byte


# --------------------------------------------------------------------------------------------
# driver


@dataclass(frozen=True)
class CalibrationResult:
    topology: Topology
    calibration: dict[str, Any]
    path: Path

    def as_json(self) -> dict[str, Any]:
        return {"path": str(self.path), "topology": self.topology.to_dict(), "calibration": self.calibration}

    def summary(self) -> str:
        t, c = self.topology, self.calibration
        p2p = c["send_recv_fit"]
        world = c["world_size"]
        lines = [
            f"wrote {self.path} ({t.name}, {c['backend']}, {world} ranks, {c['elapsed_s']:.1f} s)",
            f"  all-reduce  α {t.intra_node_latency_s * 1e6:.1f} µs/hop, B {t.intra_node_bandwidth_bytes_per_s / 1e9:.2f} GB/s",
            f"  send/recv   α {p2p['latency_s'] * 1e6:.1f} µs, B {p2p['bandwidth_bytes_per_s'] / 1e9:.2f} GB/s"
            if p2p else "  send/recv   no fit (noise swamped the size dependence)",
            f"  weight read {t.hbm_bandwidth_bytes_per_s / 1e9:.2f} GB/s per rank alone"
            + (f", {t.node_memory_bandwidth_bytes_per_s / 1e9:.2f} GB/s per node (contention "
               f"{t.contention(world):.2f} with {world} busy)" if t.node_memory_bandwidth_bytes_per_s else ""),
            f"  engine      {t.step_overhead_s * 1e3:.2f} ms per step + {t.layer_overhead_s * 1e6:.0f} µs per layer, "
            f"control broadcast {t.control_latency_s * 1e6:.0f} µs",
            f"  matmul      {t.peak_dense_flops_fp32 / 1e9:.1f} GFLOP/s float32, "
            f"{t.peak_dense_flops / 1e9:.1f} GFLOP/s bfloat16, "
            f"{t.peak_flops('int8') / 1e9:.1f} GOP/s int8 per rank",
            f"  {t.gpus_per_node} ranks per node × {t.gpu_memory_bytes / GIB:.2f} GiB",
        ]
        return "\n".join(lines)


def _usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1


def _host_memory_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def calibrate(
    out: str | Path,
    *,
    engine_decode_steps: Callable[..., dict[int, float]],
    world_size: int = 2,
    backend: str | None = None,
    name: str | None = None,
    usd_per_hour: float | None = None,
    ranks_per_node: int | None = None,
) -> CalibrationResult:
    """Measure this machine with ``world_size`` local ranks and write a topology YAML to ``out``.

    ``engine_decode_steps`` times the serving engine on the overhead models (see
    ``RankArgs.engine_decode_steps``): ``services.worker.engine_timing.engine_decode_steps_s``."""
    if world_size < 1:
        raise CalibrationError(f"world_size must be ≥ 1, got {world_size}")
    cuda = torch.cuda.is_available()
    backend = backend or ("nccl" if cuda else "gloo")
    link_world = max(2, world_size)
    if backend == "nccl" and (not cuda or torch.cuda.device_count() < link_world):
        have = torch.cuda.device_count() if cuda else 0
        raise CalibrationError(f"nccl with {link_world} ranks needs {link_world} CUDA devices, found {have}")
    cores = _usable_cores()
    threads = max(1, cores // world_size)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="shardline-calibrate-") as tmp:
        args = RankArgs(world_size=world_size, link_world=link_world, port=rendezvous_port(), backend=backend,
                        threads=threads, overhead_models=_write_overhead_models(Path(tmp)),
                        engine_decode_steps=engine_decode_steps,
                        overhead_layer_bytes=_overhead_layer_bytes(), out_path=str(Path(tmp) / "result.json"),
                        stream_bytes=stream_bytes_for_host())
        if world_size == 1:
            # Links need two processes; the one rank must then measure with no other about (a
            # waiting peer's wake-ups stall a multi-threaded rank's parallel regions).
            raw = _run_ranks(replace(args, measure_compute=False)) | {"ranks": []}
            raw["ranks"] = _run_ranks(replace(args, link_world=1, port=rendezvous_port(), measure_links=False))["ranks"]
        else:
            raw = _run_ranks(args)
    elapsed = time.perf_counter() - started

    figures = summarize_ranks(raw["ranks"], world_size)
    all_reduce = [(float(s), float(t)) for s, t in raw["all_reduce"]]
    send_recv = [(float(s), float(t)) for s, t in raw["send_recv"]]
    alpha, bandwidth = ring_alpha_bandwidth(all_reduce, link_world)
    isolated_alpha = alpha
    if "all_reduce_between_reads_s" in figures:
        # What tensor parallelism pays: an all-reduce between weight reads, every rank busy.
        n, size = link_world, figures["all_reduce_between_reads_bytes"]
        between = figures["all_reduce_between_reads_s"] - 2 * (n - 1) / n * size / bandwidth
        alpha = max(alpha, between / (2 * (n - 1)))
    try:  # for the record only (the topology's links come from the all-reduce fit)
        p2p_fit: dict[str, float] | None = dict(zip(("latency_s", "bandwidth_bytes_per_s"),
                                                    p2p_alpha_bandwidth(send_recv), strict=True))
    except CalibrationError:
        p2p_fit = None  # a shared host's noise swamped the size dependence
    flops = figures["matmul_flops_alone"]

    if backend == "nccl":
        per_node = ranks_per_node or torch.cuda.device_count()
        memory = int(torch.cuda.get_device_properties(0).total_memory)
        reserve = min(3 * GIB, memory // 4)
        device, price = "gpu", GPU_USD_PER_HOUR if usd_per_hour is None else usd_per_hour
        node_bandwidth = None  # every GPU streams its own HBM
    else:
        per_node = ranks_per_node or max(cores, world_size)
        memory = _host_memory_bytes() // per_node
        reserve = min(1 * GIB, memory // 4)  # a torch process, not a CUDA context
        device, price = "cpu", CPU_USD_PER_CORE_HOUR if usd_per_hour is None else usd_per_hour
        node_bandwidth = figures["node_gemv_bytes_per_s"]

    topology = Topology(
        name=name or f"{socket.gethostname()}-calibrated",
        gpus_per_node=per_node,
        gpu_memory_bytes=memory,
        nvlink_domain_size=per_node,
        intra_node_bandwidth_bytes_per_s=bandwidth,
        intra_node_latency_s=alpha,
        inter_node_bandwidth_bytes_per_s=bandwidth,
        inter_node_latency_s=alpha,
        hbm_bandwidth_bytes_per_s=figures["gemv_bytes_per_s_alone"],
        peak_dense_flops=flops["bfloat16"],
        peak_dense_flops_fp32=flops["float32"],
        peak_dense_flops_int8=flops.get("int8"),
        usd_per_gpu_hour=price,
        reserve_bytes=reserve,
        device=device,
        step_overhead_s=figures["step_overhead_s"],
        layer_overhead_s=figures["layer_overhead_s"],
        control_latency_s=raw["control_broadcast_s"] if world_size > 1 else 0.0,
        node_memory_bandwidth_bytes_per_s=node_bandwidth,
    )
    calibration = {
        "backend": backend,
        "world_size": world_size,
        "link_ranks": link_world,
        "threads_per_rank": threads,
        "usable_cores": cores,
        "stream_bytes": args.stream_bytes,
        "torch": str(torch.__version__),
        "host": socket.gethostname(),
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "elapsed_s": round(elapsed, 3),
        "all_reduce_samples": [[int(s), t] for s, t in all_reduce],
        "all_reduce_fit": {"latency_per_hop_s": isolated_alpha, "bandwidth_bytes_per_s": bandwidth},
        "latency_per_hop_between_reads_s": alpha,
        "send_recv_samples": [[int(s), t] for s, t in send_recv],
        "send_recv_fit": p2p_fit,
        "control_broadcast_s": raw["control_broadcast_s"],
        "figures": {k: v for k, v in figures.items() if k != "engine_decode_step_s_alone"}
        | {"engine_decode_step_s_alone": {str(k): v for k, v in figures["engine_decode_step_s_alone"].items()}},
        "ranks": [r for r in raw["ranks"] if r["rank"] < world_size],
    }
    path = Path(out)
    topology.save(path, calibration=calibration)
    return CalibrationResult(topology=topology, calibration=calibration, path=path)


def _run_ranks(args: RankArgs) -> dict[str, Any]:
    """Spawn ``args.link_world`` calibration ranks and return rank 0's measurements."""
    mp.start_processes(rank_main, args=(args,), nprocs=args.link_world, join=True, start_method="spawn")
    path = Path(args.out_path)
    if not path.exists():
        raise CalibrationError("rank 0 finished without writing its measurements")
    raw: dict[str, Any] = json.loads(path.read_text())
    path.unlink()
    return raw


def _overhead_layer_bytes() -> int:
    """Float32 weight bytes of one decoder layer of the overhead models."""
    shape = OVERHEAD_MODEL_SHAPE
    spec = ModelSpec("overhead", num_layers=1, hidden_size=shape["hidden"], num_attention_heads=shape["heads"],
                     num_key_value_heads=shape["kv_heads"], intermediate_size=shape["intermediate"],
                     vocab_size=shape["vocab"])
    return spec.params_per_layer * 4


def _write_overhead_models(directory: Path) -> dict[int, str]:
    """The random models (OVERHEAD_MODEL_LAYERS deep) the overhead measurement decodes."""
    models: dict[int, str] = {}
    for layers in OVERHEAD_MODEL_LAYERS:
        path = directory / f"overhead-{layers}-layers"
        write_tiny_model(TinyModelSpec(layers=layers, **OVERHEAD_MODEL_SHAPE), path)  # type: ignore[arg-type]
        models[layers] = str(path)
    return models


__all__ = [
    "CalibrationError",
    "CalibrationResult",
    "LinearFit",
    "calibrate",
    "fit_linear",
    "p2p_alpha_bandwidth",
    "ring_alpha_bandwidth",
]
