"""What each rank measures during `shardline plan calibrate` (runs inside the spawned ranks).

Three phases, separated by barriers:

1. **links** (every rank; for world size 1, two processes in a run of their own first, so that
   no second process is about while the one rank measures): all-reduce over message sizes, a send/recv ping-pong between ranks 0
   and 1, and a small broadcast from rank 0 (the engine's per-step plan broadcast). Small messages
   are timed in batches of a decode step's worth of calls: within a batch the *mean* counts (a
   step is a sum of dozens of collectives, so it pays their tail, and on an oversubscribed host
   the tail is most of it), across batches the *median* (one batch stalled by another program
   on a shared host is not the host's figure). The engine benchmark reads its measurement the
   same way: the median over decode steps.
2. **alone** (rank 0 works, the others wait in a barrier, which sleeps): weight-streaming
   bandwidth (a GEMV per 2 MiB matrix over twice the last-level cache, as a decode step streams
   weights that do not fit in it, one projection at a time), a plain sum over the same bytes
   (for the record), matmul FLOP/s, and the serving stack's fixed costs: the median decode step
   of the real engine on small random models of two depths; the slope per layer less that
   layer's weight reads (at the bandwidth the models' cache-sized working set gets) is the
   per-layer cost, the intercept the per-step cost.
3. **together** (every rank at once, when world_size > 1): weight streaming, alternately free
   running (what a rank gets when all are busy: the host's contention) and in lock step with a
   decode all-reduce after every matrix (what a tensor-parallel all-reduce costs between weight
   reads, which on an oversubscribed host is more than an isolated one; see :func:`together`).

Each rank runs ``threads`` torch threads (``cores // world_size``, at least 1), as the engine's
ranks do; a world of 3 on 2 cores is oversubscribed, and that is what gets measured.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from services.modeling.kernels import dense_linear, pack_dense
from services.modeling.quant import INT8, pack_int8, quant_linear, quantize

ALL_REDUCE_ELEMENTS = (1, 64, 1024, 4096, 65536, 262144, 1048576)  # float32: 4 B … 4 MiB
SMALL_MESSAGE_BATCHES = 9  # batches of calls per small size: the median batch is the figure
SMALL_MESSAGE_BATCH = 16  # calls per batch, about one decode step's collectives per layer group
LARGE_MESSAGE_ITERS = 8
CONTROL_MESSAGE_BYTES = 1024  # a pickled step plan for a handful of sequences
GEMV_SHAPE = (512, 1024)  # 2 MiB per float32 matrix: one projection of a small model's layer
COLLECTIVE_ELEMENTS = 1024  # a decode all-reduce: one token's hidden vector (4 KiB in float32)
MIN_STREAM_BYTES = 256 << 20  # the weight-streaming set when the last-level cache size is unknown
OVERHEAD_PROMPT_TOKENS = 16
OVERHEAD_DECODE_TOKENS = 32
COLLECTIVE_TIMEOUT_S = 600.0  # the "alone" phase keeps the other ranks waiting in a barrier


@dataclass(frozen=True)
class RankArgs:
    """What every calibration rank is told (picklable: it crosses the spawn)."""

    world_size: int  # ranks the topology describes: they compute at once in phase 3
    link_world: int  # ranks in the process group: max(2, world_size), links need two
    port: int
    backend: str
    threads: int
    overhead_models: dict[int, str]  # layers → random model directory
    # The serving engine's median decode step on each overhead model, keyed alike (called as
    # ``engine_decode_steps(models, prompt_tokens=..., decode_tokens=...)``): the worker's
    # ``services.worker.engine_timing.engine_decode_steps_s``, passed in by whoever calibrates,
    # since the planner sits below the worker. A module-level function, so it pickles.
    engine_decode_steps: Callable[..., dict[int, float]]
    overhead_layer_bytes: int  # weight bytes one of their layers streams
    out_path: str
    stream_bytes: int  # weights streamed per pass, across the ranks streaming at once
    measure_links: bool = True  # phase 1
    measure_compute: bool = True  # phases 2 and 3


def last_level_cache_bytes() -> int:
    """Size of this host's largest CPU cache (sysfs), 0 if unknown. Servers' L3 reaches hundreds
    of MiB: a weight-streaming measurement must exceed it, as a model's weights do."""
    sizes = [0]
    for entry in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        text = entry.read_text().strip().upper()
        units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
        try:
            sizes.append(int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text))
        except (ValueError, IndexError):
            continue
    return max(sizes)


def stream_bytes_for_host() -> int:
    """Twice the last-level cache (at least 256 MiB): streamed cyclically, that set misses the
    cache as a model's weights do, and DRAM bandwidth is what gets measured."""
    return max(MIN_STREAM_BYTES, 2 * last_level_cache_bytes())


def mean_seconds(fn: Callable[[], object], iters: int, sync: Callable[[], None], *, warm: bool = True) -> float:
    """Mean seconds per call over exactly ``iters`` calls (after one warm-up call if ``warm``).

    Collectives must run the same number of times on every rank, so the loop length never
    depends on the clock.
    """
    if warm:
        fn()
        sync()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    sync()
    return (time.perf_counter() - start) / iters


def median_batch_mean(fn: Callable[[], object], batches: int, batch: int, sync: Callable[[], None]) -> float:
    """Median over ``batches`` of the mean seconds per call within a batch of ``batch`` calls
    (a fixed count: collectives must run as often on every rank)."""
    fn()
    sync()
    return statistics.median(mean_seconds(fn, batch, sync, warm=False) for _ in range(batches))


def median_for(fn: Callable[[], object], seconds: float, sync: Callable[[], None], *, min_iters: int = 5) -> float:
    """Median seconds per call over at least ``seconds`` and ``min_iters`` calls (local work only)."""
    fn()
    sync()
    samples: list[float] = []
    start = time.perf_counter()
    while len(samples) < min_iters or time.perf_counter() - start < seconds:
        t0 = time.perf_counter()
        fn()
        sync()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


class WeightStream:
    """Float32 matrices of a decode-sized layer (GEMV_SHAPE, 2 MiB) totalling ``total_bytes``,
    streamed through ``y = x·Wᵀ`` at batch 1 as a decode step streams a model's weights: one
    GEMV (one parallel region) per matrix, the set too large to stay in cache."""

    def __init__(self, device: Any, total_bytes: int) -> None:
        count = max(1, -(-total_bytes // (GEMV_SHAPE[0] * GEMV_SHAPE[1] * 4)))
        self.weights = [torch.randn(*GEMV_SHAPE, device=device) for _ in range(count)]
        self.x = torch.randn(1, GEMV_SHAPE[1], device=device)
        self.vector = torch.ones(COLLECTIVE_ELEMENTS, device=device)
        self.nbytes = sum(w.numel() * w.element_size() for w in self.weights)

    def free_pass(self) -> None:
        for w in self.weights:
            torch.nn.functional.linear(self.x, w)

    def lockstep_pass(self) -> None:
        """Every matrix followed by a decode-sized all-reduce, as tensor-parallel ranks do."""

        for w in self.weights:
            torch.nn.functional.linear(self.x, w)
            dist.all_reduce(self.vector)


def gemv_bandwidth(device: Any, sync: Callable[[], None], total_bytes: int, *, seconds: float = 0.6) -> float:
    """Bytes/s of one rank streaming ``total_bytes`` of weights (see :class:`WeightStream`)."""
    stream = WeightStream(device, total_bytes)
    return stream.nbytes / median_for(stream.free_pass, seconds, sync)


def together(device: Any, sync: Callable[[], None], total_bytes: int, *, rounds: int = 3) -> dict[str, float]:
    """Every rank of the world streams its share of ``total_bytes`` at once, alternately free
    running and in lock step (a decode all-reduce after every matrix); medians over ``rounds``.

    The free passes give what each rank streams when all are busy (the host's contention); the
    lock-step passes cost more than free passes plus isolated all-reduces on an oversubscribed
    host, because the rank left without a core holds up every collective. Their difference per
    matrix is the cost of one decode all-reduce between weight reads, which is how tensor
    parallelism uses it.
    """
    stream = WeightStream(device, total_bytes)
    free: list[float] = []
    lockstep: list[float] = []
    stream.free_pass()
    stream.lockstep_pass()
    for _ in range(rounds):
        for fn, samples in ((stream.free_pass, free), (stream.lockstep_pass, lockstep)):
            dist.barrier()
            samples.append(mean_seconds(fn, 1, sync, warm=False))
    free_s, lockstep_s = statistics.median(free), statistics.median(lockstep)
    return {"gemv_bytes_per_s": stream.nbytes / free_s, "matrices": len(stream.weights),
            "free_pass_s": free_s, "lockstep_pass_s": lockstep_s,
            "all_reduce_between_reads_s": max(0.0, (lockstep_s - free_s) / len(stream.weights)),
            "all_reduce_bytes": COLLECTIVE_ELEMENTS * 4}


def sum_bandwidth(device: Any, sync: Callable[[], None], total_bytes: int) -> float:
    big = torch.ones(total_bytes // 4, dtype=torch.float32, device=device)
    return big.numel() * 4 / median_for(big.sum, 0.3, sync)


def matmul_flops(device: Any, sync: Callable[[], None]) -> dict[str, float]:
    """FLOP/s of a 512-cube matmul in float32 (torch's), and as a layer runs it in bfloat16
    (``dense_linear`` on the weight as the layer holds it: on CPU our kernel, packed where the
    machine packs) and in an int8 plan (``quant_linear``: on CPU the W8A8 kernel)."""
    out: dict[str, float] = {}
    n = 512
    a = torch.randn(n, n, device=device)
    b = torch.randn(n, n, device=device)
    out["float32"] = 2 * n**3 / median_for(lambda: torch.mm(a, b), 0.2, sync)
    x = torch.randn(n, n, device=device).to(torch.bfloat16)
    dense = pack_dense(torch.randn(n, n, device=device).to(torch.bfloat16))
    out["bfloat16"] = 2 * n**3 / median_for(lambda: dense_linear(x, dense), 0.2, sync)
    q, scale = quantize(torch.randn(n, n, device=device), INT8)
    weight = pack_int8(q)
    out["int8"] = 2 * n**3 / median_for(lambda: quant_linear(x, weight, scale), 0.2, sync)
    return out


def rank_main(rank: int, args: RankArgs) -> None:
    """Entry point of one calibration rank (torch.multiprocessing.start_processes)."""

    torch.set_num_threads(args.threads)
    use_cuda = args.backend == "nccl"
    device = torch.device("cuda", rank) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    dist.init_process_group(args.backend, init_method=f"tcp://127.0.0.1:{args.port}", rank=rank,
                            world_size=args.link_world, timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S))

    def sync() -> None:
        if use_cuda:
            torch.cuda.synchronize(device)

    try:
        links = _measure_links(rank, device, sync) if args.measure_links else {}
        mine: dict[str, Any] = {"rank": rank}
        if args.measure_compute:
            _measure_compute(rank, args, device, sync, mine)
        gathered: list[Any] = [None] * args.link_world
        dist.all_gather_object(gathered, mine)
        if rank == 0:
            Path(args.out_path).write_text(json.dumps({**links, "ranks": gathered}))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _measure_compute(rank: int, args: RankArgs, device: Any, sync: Callable[[], None], mine: dict[str, Any]) -> None:
    dist.barrier()
    if rank == 0:
        mine["alone"] = {
            "gemv_bytes_per_s": gemv_bandwidth(device, sync, args.stream_bytes),
            "memory_read_bytes_per_s": sum_bandwidth(device, sync, args.stream_bytes),
            "matmul_flops": matmul_flops(device, sync),
            "decode_step_s": args.engine_decode_steps(args.overhead_models, prompt_tokens=OVERHEAD_PROMPT_TOKENS,
                                                      decode_tokens=OVERHEAD_DECODE_TOKENS),
            # What the deepest overhead model's weights stream at: subtracted from its layers.
            "overhead_stream_bytes_per_s": gemv_bandwidth(
                device, sync, max(args.overhead_models) * args.overhead_layer_bytes, seconds=0.3),
            "overhead_layer_bytes": args.overhead_layer_bytes,
        }
    dist.barrier()
    if args.world_size > 1:  # link_world == world_size: every rank takes part
        # The ranks share the last-level cache: together they stream the same total.
        mine["together"] = together(device, sync, args.stream_bytes // args.world_size)
    dist.barrier()


def _measure_links(rank: int, device: Any, sync: Callable[[], None]) -> dict[str, Any]:
    def timed(fn: Callable[[], object], numel: int) -> float:
        if numel <= 4096:
            return median_batch_mean(fn, SMALL_MESSAGE_BATCHES, SMALL_MESSAGE_BATCH, sync)
        return mean_seconds(fn, LARGE_MESSAGE_ITERS, sync)

    all_reduce: list[tuple[int, float]] = []
    for numel in ALL_REDUCE_ELEMENTS:
        x = torch.ones(numel, dtype=torch.float32, device=device)
        dist.barrier()
        all_reduce.append((numel * 4, timed(lambda x=x: dist.all_reduce(x), numel)))

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
        send_recv.append((numel * 4, timed(ping, numel) / 2))

    # The engine's control messages travel on a gloo group even when data uses NCCL.
    control = torch.zeros(CONTROL_MESSAGE_BYTES, dtype=torch.uint8)
    dist.barrier()
    control_s = median_batch_mean(lambda: dist.broadcast(control, src=0), SMALL_MESSAGE_BATCHES,
                                  SMALL_MESSAGE_BATCH, lambda: None)
    return {"all_reduce": all_reduce, "send_recv": send_recv, "control_broadcast_s": control_s}


def summarize_ranks(ranks: list[dict[str, Any]], world_size: int) -> dict[str, Any]:
    """The figures the topology is built from, out of every rank's raw measurements."""
    alone = ranks[0]["alone"]
    steps = {int(layers): t for layers, t in alone["decode_step_s"].items()}
    shallow, deep = min(steps), max(steps)
    slope = (steps[deep] - steps[shallow]) / (deep - shallow)  # one layer: its reads + fixed cost
    per_layer = max(0.0, slope - alone["overhead_layer_bytes"] / alone["overhead_stream_bytes_per_s"])
    per_step = max(0.0, steps[shallow] - shallow * slope)
    figures: dict[str, Any] = {
        "gemv_bytes_per_s_alone": alone["gemv_bytes_per_s"],
        "memory_read_bytes_per_s_alone": alone["memory_read_bytes_per_s"],
        "matmul_flops_alone": alone["matmul_flops"],
        "engine_decode_step_s_alone": steps,
        "layer_overhead_s": per_layer,
        "step_overhead_s": per_step,
    }
    if world_size == 1:  # one rank has the host to itself: nothing to share
        figures["node_gemv_bytes_per_s"] = alone["gemv_bytes_per_s"]
        return figures
    together = [r["together"] for r in ranks[:world_size]]
    slowest = min(t["gemv_bytes_per_s"] for t in together)
    figures |= {
        "gemv_bytes_per_s_together": slowest,
        # The slowest rank sets the pace of ranks in lock step, so the node figure is that
        # rank's rate times the ranks sharing the node.
        "node_gemv_bytes_per_s": world_size * slowest,
        # Every rank waits in each all-reduce, so they all see the same cost; the median rank's.
        "all_reduce_between_reads_s": statistics.median(t["all_reduce_between_reads_s"] for t in together),
        "all_reduce_between_reads_bytes": together[0]["all_reduce_bytes"],
    }
    return figures


__all__ = ["ALL_REDUCE_ELEMENTS", "RankArgs", "rank_main",
           "summarize_ranks"]
