"""Measure the machine we run on and write a topology the planner accepts.

`shardline plan calibrate --out topology.yaml [--world-size 2]` launches ``world_size`` local
ranks (torch.multiprocessing spawn; gloo on CPU, NCCL when CUDA is present) and measures:

* all-reduce time for small (latency-bound) and large (bandwidth-bound) messages, fitted to the
  ring model by weighted least squares (weights 1/t², i.e. relative error, so the microsecond
  points pin α and the megabyte points pin B)::

      t(S) = a + b·S,   a = 2(n−1)·α,   b = 2(n−1)/(n·B)   →   α = a / 2(n−1),  B = 2(n−1) / (n·b)

* send/recv one-way time (half a ping-pong) fitted to ``t(S) = α + S/B``;
* memory read bandwidth: every rank sums a large tensor at once, as the engine's ranks read
  their weights at once (bytes / seconds, the slowest rank's figure);
* matmul throughput (2·n³ / seconds) for float32 and bfloat16, every rank at once.

On a CPU host each rank stands in for a "GPU": ``gpus_per_node`` is the number of usable cores
(each rank gets ``cores // world_size`` threads while measuring), ``gpu_memory_bytes`` is host
memory divided among them, the NVLink domain is the whole host, and since there is no second node
the inter-node link repeats the loopback figures. The raw samples and fits are kept in the file
under ``calibration`` (the planner ignores that block).
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import tempfile
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

from services.planner.topology import GIB, Topology

ALL_REDUCE_ELEMENTS = (1, 64, 1024, 4096, 65536, 262144, 1048576)  # float32: 4 B … 4 MiB
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
# the ranks


def _timed(fn, *, min_iters: int, min_seconds: float, sync) -> float:  # noqa: ANN001
    """Median seconds per call over ≥ min_iters calls and ≥ min_seconds."""
    fn()
    sync()
    samples: list[float] = []
    start = time.perf_counter()
    while len(samples) < min_iters or time.perf_counter() - start < min_seconds:
        t0 = time.perf_counter()
        fn()
        sync()
        samples.append(time.perf_counter() - t0)
        if len(samples) >= 200:
            break
    return statistics.median(samples)


def _fixed(fn, iters: int, sync) -> float:  # noqa: ANN001
    """Median seconds per call over exactly ``iters`` calls after one warm-up.

    Collectives must run the same number of times on every rank, so unlike :func:`_timed` the
    loop length never depends on the clock.
    """
    fn()
    sync()
    samples = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        sync()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def _rank_main(rank: int, world_size: int, port: int, backend: str, threads: int, out_path: str) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(threads)
    use_cuda = backend == "nccl"
    device = torch.device("cuda", rank) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world_size, timeout=timedelta(seconds=60))

    def sync() -> None:
        if use_cuda:
            torch.cuda.synchronize(device)

    try:
        all_reduce: list[tuple[int, float]] = []
        for numel in ALL_REDUCE_ELEMENTS:
            x = torch.ones(numel, dtype=torch.float32, device=device)
            dist.barrier()
            iters = 20 if numel <= 4096 else 5
            t = _fixed(lambda x=x: dist.all_reduce(x), iters, sync)
            all_reduce.append((numel * 4, t))

        send_recv: list[tuple[int, float]] = []
        for numel in ALL_REDUCE_ELEMENTS:
            x = torch.ones(numel, dtype=torch.float32, device=device)
            dist.barrier()
            if rank == 0:
                def ping(x=x) -> None:
                    dist.send(x, dst=1)
                    dist.recv(x, src=1)
            elif rank == 1:
                def ping(x=x) -> None:
                    dist.recv(x, src=0)
                    dist.send(x, dst=0)
            else:
                def ping() -> None:
                    return None
            iters = 20 if numel <= 4096 else 5
            send_recv.append((numel * 4, _fixed(ping, iters, sync) / 2))

        # Memory read: every rank sums its own 128 MiB tensor at the same time.
        big = torch.ones(32 * 1024 * 1024, dtype=torch.float32, device=device)
        dist.barrier()
        t = _timed(lambda: big.sum(), min_iters=5, min_seconds=0.2, sync=sync)
        mem_bw = big.numel() * 4 / t
        del big

        matmul: dict[str, float] = {}
        for name, dtype, n in (("float32", torch.float32, 512), ("bfloat16", torch.bfloat16, 512)):
            a = torch.randn(n, n, device=device).to(dtype)
            b = torch.randn(n, n, device=device).to(dtype)
            dist.barrier()
            t = _timed(lambda a=a, b=b: torch.mm(a, b), min_iters=3, min_seconds=0.2, sync=sync)
            matmul[name] = 2 * n**3 / t

        mine = {"rank": rank, "memory_read_bytes_per_s": mem_bw, "matmul_flops": matmul}
        gathered: list[Any] = [None] * world_size
        dist.all_gather_object(gathered, mine)
        if rank == 0:
            Path(out_path).write_text(json.dumps({
                "all_reduce": all_reduce,
                "send_recv": send_recv,
                "ranks": gathered,
            }))
        dist.barrier()
    finally:
        dist.destroy_process_group()


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
        return (
            f"wrote {self.path} ({t.name}, {c['backend']}, {c['world_size']} ranks, {c['elapsed_s']:.1f} s)\n"
            f"  all-reduce  α {t.intra_node_latency_s * 1e6:.1f} µs/hop, B {t.intra_node_bandwidth_bytes_per_s / 1e9:.2f} GB/s\n"
            f"  send/recv   α {c['send_recv_fit']['latency_s'] * 1e6:.1f} µs, "
            f"B {c['send_recv_fit']['bandwidth_bytes_per_s'] / 1e9:.2f} GB/s\n"
            f"  memory read {t.hbm_bandwidth_bytes_per_s / 1e9:.2f} GB/s per rank\n"
            f"  matmul      {t.peak_dense_flops_fp32 / 1e9:.1f} GFLOP/s float32, "
            f"{t.peak_dense_flops / 1e9:.1f} GFLOP/s bfloat16 per rank\n"
            f"  {t.gpus_per_node} ranks per node × {t.gpu_memory_bytes / GIB:.2f} GiB"
        )


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


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
    world_size: int = 2,
    backend: str | None = None,
    name: str | None = None,
    usd_per_hour: float | None = None,
    ranks_per_node: int | None = None,
) -> CalibrationResult:
    """Measure this machine with ``world_size`` local ranks and write a topology YAML to ``out``."""
    import torch
    import torch.multiprocessing as mp

    if world_size < 2:
        raise CalibrationError(f"world_size must be ≥ 2 to measure collectives, got {world_size}")
    cuda = torch.cuda.is_available()
    backend = backend or ("nccl" if cuda else "gloo")
    if backend == "nccl" and (not cuda or torch.cuda.device_count() < world_size):
        have = torch.cuda.device_count() if cuda else 0
        raise CalibrationError(f"nccl with world_size {world_size} needs {world_size} CUDA devices, found {have}")
    cores = _usable_cores()
    threads = max(1, cores // world_size)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="shardline-calibrate-") as tmp:
        result_path = Path(tmp) / "result.json"
        mp.start_processes(
            _rank_main,
            args=(world_size, _free_port(), backend, threads, str(result_path)),
            nprocs=world_size,
            join=True,
            start_method="spawn",
        )
        if not result_path.exists():
            raise CalibrationError("rank 0 finished without writing its measurements")
        raw = json.loads(result_path.read_text())
    elapsed = time.perf_counter() - started

    all_reduce = [(float(s), float(t)) for s, t in raw["all_reduce"]]
    send_recv = [(float(s), float(t)) for s, t in raw["send_recv"]]
    alpha, bandwidth = ring_alpha_bandwidth(all_reduce, world_size)
    p2p_alpha, p2p_bandwidth = p2p_alpha_bandwidth(send_recv)
    ranks = raw["ranks"]
    mem_bw = min(r["memory_read_bytes_per_s"] for r in ranks)
    flops32 = min(r["matmul_flops"]["float32"] for r in ranks)
    flops16 = min(r["matmul_flops"]["bfloat16"] for r in ranks)

    if backend == "nccl":
        per_node = ranks_per_node or torch.cuda.device_count()
        memory = int(torch.cuda.get_device_properties(0).total_memory)
        reserve = min(3 * GIB, memory // 4)
        device, price = "gpu", GPU_USD_PER_HOUR if usd_per_hour is None else usd_per_hour
    else:
        per_node = ranks_per_node or max(cores, world_size)
        memory = _host_memory_bytes() // per_node
        reserve = min(1 * GIB, memory // 4)  # a torch process, not a CUDA context
        device, price = "cpu", CPU_USD_PER_CORE_HOUR if usd_per_hour is None else usd_per_hour

    topology = Topology(
        name=name or f"{socket.gethostname()}-calibrated",
        gpus_per_node=per_node,
        gpu_memory_bytes=memory,
        nvlink_domain_size=per_node,
        intra_node_bandwidth_bytes_per_s=bandwidth,
        intra_node_latency_s=alpha,
        inter_node_bandwidth_bytes_per_s=bandwidth,
        inter_node_latency_s=alpha,
        hbm_bandwidth_bytes_per_s=mem_bw,
        peak_dense_flops=flops16,
        peak_dense_flops_fp32=flops32,
        usd_per_gpu_hour=price,
        reserve_bytes=reserve,
        device=device,
    )
    calibration = {
        "backend": backend,
        "world_size": world_size,
        "threads_per_rank": threads,
        "torch": str(torch.__version__),
        "host": socket.gethostname(),
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "elapsed_s": round(elapsed, 3),
        "all_reduce_samples": [[int(s), t] for s, t in all_reduce],
        "all_reduce_fit": {"latency_per_hop_s": alpha, "bandwidth_bytes_per_s": bandwidth},
        "send_recv_samples": [[int(s), t] for s, t in send_recv],
        "send_recv_fit": {"latency_s": p2p_alpha, "bandwidth_bytes_per_s": p2p_bandwidth},
        "ranks": ranks,
    }
    path = Path(out)
    topology.save(path, calibration=calibration)
    return CalibrationResult(topology=topology, calibration=calibration, path=path)


__all__ = [
    "CalibrationError",
    "CalibrationResult",
    "LinearFit",
    "calibrate",
    "fit_linear",
    "p2p_alpha_bandwidth",
    "ring_alpha_bandwidth",
]
