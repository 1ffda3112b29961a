"""Planner benchmark: the cost model's predicted decode step against the engine's, per layout.

``python -m bench.planner [--model smollm2|DIR] [--rounds 3]`` (or ``shardline bench planner``)
does, for each layout (TP, PP) = (1, 1), (3, 1), (1, 2), in every round:

1. ``shardline plan calibrate --world-size W --ranks-per-node W`` with W = TP·PP, the world
   size the engine will run at (each rank gets cores // W threads; 3 ranks on 2 cores is an
   oversubscribed host, and the calibration measures it so);
2. predicts the decode step at batch 1 from that topology: ``CostModel(model, topology,
   workload).tpot_s(Candidate(tp, pp, dtype), 1)``, the average context being the prompt plus
   half the generated tokens;
3. measures the real engine (``services.worker.engine``: spawned ranks, gloo, the driver's
   scheduler, sampler and streaming) generating greedily at batch 1: the time between
   consecutive tokens as the driver streams them, the median over every decode step of a few
   requests (the median inter-token latency; the mean is kept too). A shared host stalls some
   steps for reasons of its own; the median is the step the engine takes, as the calibration's
   figures are medians over batches.

Calibration and measurement of a layout run back to back so both see the same machine. A round
during which other programs used more than 10 % of the host's CPU time is redone (up to three
times): on a shared host it would time them, and a rank with several torch threads slows down
many times over while they run. The table reports the medians over the rounds and the error of
predicted against measured (exit status 1 when a layout is off by more than ±25 %). Writes
``bench/results/planner.json`` and ``planner.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from bench.common import smollm2_dir
from services.planner.calibrate import calibrate
from services.planner.cost_model import Candidate, CostModel, Workload
from services.planner.specs import ModelSpec
from services.worker.engine.bootstrap import build_engine, start_rank
from services.worker.engine.kv_cache import CacheConfig
from services.worker.engine.runner import follower_loop
from services.worker.engine_timing import decode_intervals_s, engine_decode_steps_s
from services.worker.launch import run_replica_group
from services.worker.runtime import RankSpec

RESULTS = Path(__file__).resolve().parent / "results"
LAYOUTS: tuple[tuple[int, int], ...] = ((1, 1), (3, 1), (1, 2))
TOLERANCE = 0.25
MAX_OTHERS_CPU_SHARE = 0.10  # a round during which other programs used more of the CPUs is redone
PROMPT_TOKENS = 16
KV_CACHE_BYTES = 64 << 20
COLLECTIVE_TIMEOUT_S = 60.0  # a loaded 2-core host can stall a collective for seconds


@dataclass
class Round:
    """One calibration + measurement of one layout."""

    predicted_s: float
    measured_s: float  # median inter-token latency
    measured_mean_s: float
    intervals_s: list[float]
    topology: dict[str, Any]
    calibration_s: float
    measurement_s: float
    others_cpu_share: float = 0.0  # of the host's CPU time during the round, used by other programs

    @property
    def error(self) -> float:
        return self.predicted_s / self.measured_s - 1


@dataclass
class LayoutResult:
    tp: int
    pp: int
    rounds: list[Round] = field(default_factory=list)
    discarded: list[Round] = field(default_factory=list)  # redone: other programs were busy

    @property
    def disturbed(self) -> bool:
        """Whether a kept round still had other programs busy (its retries ran out)."""
        return any(r.others_cpu_share > MAX_OTHERS_CPU_SHARE for r in self.rounds)

    @property
    def predicted_s(self) -> float:
        return statistics.median(r.predicted_s for r in self.rounds)

    @property
    def measured_s(self) -> float:
        return statistics.median(r.measured_s for r in self.rounds)

    @property
    def error(self) -> float:
        """Predicted against measured, each the median over the rounds."""
        return self.predicted_s / self.measured_s - 1

    @property
    def within_tolerance(self) -> bool:
        return abs(self.error) <= TOLERANCE


# ---- the host ---------------------------------------------------------------------------------


def host_busy_fraction(seconds: float = 1.0) -> float:
    """Fraction of all CPUs' time spent busy over ``seconds`` (from /proc/stat), 0 if unknown.

    Other programs on a shared host move every figure here, and a multi-threaded one makes a
    rank with several torch threads collapse (its parallel regions wait for a descheduled
    thread): the comparison means something only on a quiet host.
    """
    def snapshot() -> tuple[int, int] | None:
        try:
            fields = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
        except (OSError, ValueError, IndexError):
            return None
        idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
        return sum(fields), idle

    first = snapshot()
    time.sleep(seconds)
    second = snapshot()
    if first is None or second is None or second[0] == first[0]:
        return 0.0
    total, idle = second[0] - first[0], second[1] - first[1]
    return max(0.0, 1.0 - idle / total)


@dataclass(frozen=True)
class CpuClock:
    """CPU seconds so far: the whole host's capacity, its busy time, and this process tree's."""

    total_s: float
    busy_s: float
    ours_s: float

    @classmethod
    def now(cls) -> CpuClock:
        tick = os.sysconf("SC_CLK_TCK")
        try:
            fields = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
        except (OSError, ValueError, IndexError):
            fields = [0, 0, 0, 0]
        idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
        # Children count once they have been waited for, as the spawned ranks are when they join.
        t = os.times()
        return cls(sum(fields) / tick, (sum(fields) - idle) / tick,
                   t.user + t.system + t.children_user + t.children_system)

    def others_share_since(self, start: CpuClock) -> float:
        """Fraction of the host's CPU time other programs used between ``start`` and this."""
        total = self.total_s - start.total_s
        if total <= 0:
            return 0.0
        return max(0.0, ((self.busy_s - start.busy_s) - (self.ours_s - start.ours_s)) / total)


def wait_for_quiet_host(*, busy_below: float = 0.25, max_wait_s: float = 180.0) -> float:
    """Wait until the host's CPUs are less than ``busy_below`` busy (2-second samples), at
    most ``max_wait_s``; returns the last busy fraction seen."""
    deadline = time.monotonic() + max_wait_s
    busy = host_busy_fraction(2.0)
    while busy >= busy_below and time.monotonic() < deadline:
        busy = host_busy_fraction(2.0)
    return busy


# ---- the engine ------------------------------------------------------------------------------


def _decode_rank(rank: int, world_size: int, spec: Any, prompt: list[int], decode_tokens: int,
                 requests: int) -> list[float] | None:
    """Rank entry point: one warm-up request, then ``requests`` greedy requests one at a time;
    the driver returns the seconds between consecutive tokens of all of them."""
    runner, layout = start_rank(spec, rank)
    if rank != 0:
        follower_loop(runner)
        return None
    engine = build_engine(spec, runner, layout)
    intervals: list[float] = []
    try:
        decode_intervals_s(engine, prompt, 4)
        for _ in range(requests):
            intervals += decode_intervals_s(engine, prompt, decode_tokens)
    finally:
        engine.shutdown()
    return intervals


def measure_decode(model_dir: Path, tp: int, pp: int, *, dtype: str = "float32", decode_tokens: int = 32,
                   requests: int = 2) -> list[float]:
    """Inter-token latencies of ``requests`` batch-1 greedy requests on the real engine at (tp, pp)."""
    spec = RankSpec(str(model_dir), tp_degree=tp, pp_degree=pp, dtype=dtype, collective_timeout_s=COLLECTIVE_TIMEOUT_S,
                    cache=CacheConfig(kv_cache_bytes=KV_CACHE_BYTES))
    prompt = list(range(10, 10 + PROMPT_TOKENS))
    return run_replica_group(tp * pp, _decode_rank, spec, prompt, decode_tokens, requests)


# ---- the planner -----------------------------------------------------------------------------


def predict_decode(model_dir: Path, topology: Any, tp: int, pp: int, *, dtype: str = "float32",
                   decode_tokens: int = 32) -> float:
    """The cost model's decode step (TPOT at batch 1) for this layout on ``topology``."""
    model = ModelSpec.from_config_file(model_dir)
    workload = Workload(kv_cap_bytes=KV_CACHE_BYTES, avg_context=PROMPT_TOKENS + decode_tokens // 2)
    return CostModel(model, topology, workload).tpot_s(Candidate(tp, pp, dtype), 1)


def run_round(model_dir: Path, tp: int, pp: int, workdir: Path, *, decode_tokens: int, requests: int) -> Round:
    world = tp * pp
    clock = CpuClock.now()
    started = time.perf_counter()
    calibrated = calibrate(workdir / f"topology-w{world}.yaml", engine_decode_steps=engine_decode_steps_s,
                           world_size=world, ranks_per_node=world)
    calibration_s = time.perf_counter() - started
    predicted = predict_decode(model_dir, calibrated.topology, tp, pp, decode_tokens=decode_tokens)
    started = time.perf_counter()
    samples = measure_decode(model_dir, tp, pp, decode_tokens=decode_tokens, requests=requests)
    measurement_s = time.perf_counter() - started
    return Round(predicted_s=predicted, measured_s=statistics.median(samples), measured_mean_s=statistics.mean(samples),
                 intervals_s=samples, topology=calibrated.topology.to_dict(), calibration_s=calibration_s,
                 measurement_s=measurement_s, others_cpu_share=CpuClock.now().others_share_since(clock))


def compare(model_dir: Path, *, rounds: int = 3, decode_tokens: int = 32, requests: int = 2,
            layouts: tuple[tuple[int, int], ...] = LAYOUTS, attempts: int = 3, log: Any = None) -> list[LayoutResult]:
    """Calibrate, predict and measure every layout ``rounds`` times (layouts interleaved).

    A round during which other programs used more than MAX_OTHERS_CPU_SHARE of the host's CPU
    time is redone, up to ``attempts`` times (the last attempt is kept, and the layout reports
    itself ``disturbed``): on a shared host such a round times the other programs, and a rank
    with several torch threads can run many times slower while they do.
    """
    results = [LayoutResult(tp, pp) for tp, pp in layouts]
    with tempfile.TemporaryDirectory(prefix="shardline-bench-planner-") as tmp:
        for r in range(rounds):
            for result in results:
                for attempt in range(attempts):
                    one = run_round(model_dir, result.tp, result.pp, Path(tmp), decode_tokens=decode_tokens,
                                    requests=requests)
                    quiet = one.others_cpu_share <= MAX_OTHERS_CPU_SHARE
                    if log is not None:
                        print(f"round {r + 1}/{rounds} TP{result.tp}/PP{result.pp}: predicted "
                              f"{one.predicted_s * 1e3:.1f} ms, measured {one.measured_s * 1e3:.1f} ms "
                              f"({one.error:+.1%}); other programs used {one.others_cpu_share:.0%} of the CPUs"
                              + ("" if quiet else " — redo" if attempt + 1 < attempts else " — kept, retries spent"),
                              file=log, flush=True)
                    if quiet or attempt + 1 == attempts:
                        result.rounds.append(one)
                        break
                    result.discarded.append(one)
    return results


# ---- output ----------------------------------------------------------------------------------


def table(results: list[LayoutResult]) -> str:
    lines = ["| layout | ranks | predicted decode step | measured decode step | error | within ±25 % |",
             "|---|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| TP{r.tp}/PP{r.pp} | {r.tp * r.pp} | {r.predicted_s * 1e3:.1f} ms | "
                     f"{r.measured_s * 1e3:.1f} ms | {r.error:+.1%} | {'yes' if r.within_tolerance else 'no'} |")
    return "\n".join(lines)


def topology_table(results: list[LayoutResult]) -> str:
    """What each world size's calibration found (medians over the rounds)."""
    lines = ["| world size | weight read alone | contention, all busy | all-reduce α/hop | layer overhead | "
             "step overhead | control broadcast |", "|---|---|---|---|---|---|---|"]
    seen: set[int] = set()
    for r in results:
        world = r.tp * r.pp
        if world in seen:
            continue
        seen.add(world)

        def med(key: str, rounds: list[Round] = r.rounds) -> float:
            return statistics.median(float(x.topology[key] or 0.0) for x in rounds)

        node = med("node_memory_bandwidth_bytes_per_s")
        contention = max(1.0, world * med("hbm_bandwidth_bytes_per_s") / node) if node and world > 1 else 1.0
        lines.append(f"| {world} | {med('hbm_bandwidth_bytes_per_s') / 1e9:.1f} GB/s | {contention:.2f} | "
                     f"{med('intra_node_latency_s') * 1e6:.0f} µs | {med('layer_overhead_s') * 1e6:.0f} µs | "
                     f"{med('step_overhead_s') * 1e3:.2f} ms | {med('control_latency_s') * 1e6:.0f} µs |")
    return "\n".join(lines)


def write_results(results: list[LayoutResult], model_dir: Path, out: Path, *, rounds: int,
                  decode_tokens: int, requests: int, busy_before: float) -> dict[str, Any]:
    model = ModelSpec.from_config_file(model_dir)
    name = display_name(model_dir)
    data = {
        "model": model.to_dict() | {"name": name, "parameters": model.num_parameters, "dtype": "float32"},
        "host": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": sys.version.split()[0],
                 "load_average_1m_after": os.getloadavg()[0], "cpu_busy_before": busy_before},
        "method": {"rounds": rounds, "decode_tokens": decode_tokens, "requests_per_round": requests,
                   "prompt_tokens": PROMPT_TOKENS, "tolerance": TOLERANCE,
                   "predicted": "CostModel.tpot_s(candidate, 1) on the topology calibrated at world size TP·PP",
                   "measured": "engine decode step at batch 1: median time between consecutive streamed tokens"},
        "layouts": [{"tp": r.tp, "pp": r.pp, "predicted_ms": r.predicted_s * 1e3, "measured_ms": r.measured_s * 1e3,
                     "error": r.error, "within_tolerance": r.within_tolerance, "disturbed": r.disturbed,
                     "rounds": [asdict(x) | {"error": x.error} for x in r.rounds],
                     "discarded_rounds": [asdict(x) | {"error": x.error} for x in r.discarded]}
                    for r in results],
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "planner.json").write_text(json.dumps(data, indent=2) + "\n")
    md = [
        "# Planner benchmark: predicted vs measured decode step",
        "",
        f"Model: {name} ({model.num_parameters / 1e6:.1f}M parameters, {model.num_layers} layers, float32), "
        f"batch 1, {PROMPT_TOKENS}-token prompt, {decode_tokens} generated tokens, {requests} requests per round, "
        f"median of {rounds} rounds. Host: {os.cpu_count()} CPUs, gloo; CPUs {busy_before:.0%} busy before the "
        f"run, 1-minute load average {os.getloadavg()[0]:.1f} after it (the host is shared with other work, "
        "which moves single rounds a lot: the JSON has every round).",
        "",
        table(results),
        "",
        "Predicted: `CostModel(...).tpot_s(Candidate(tp, pp, 'float32'), 1)` on the topology that "
        "`shardline plan calibrate --world-size TP·PP --ranks-per-node TP·PP` wrote just before the measurement. "
        "Measured: the serving engine's decode step, the median time between consecutive streamed tokens "
        "(the mean is in the JSON).",
        "",
        "Rounds redone because other programs used more than 10 % of the CPUs: "
        + (", ".join(f"TP{r.tp}/PP{r.pp} {len(r.discarded)}" for r in results if r.discarded) or "none")
        + ("; still disturbed after the retries: " + ", ".join(f"TP{r.tp}/PP{r.pp}" for r in results if r.disturbed)
           if any(r.disturbed for r in results) else "") + ".",
        "",
        "What the calibrations found (medians):",
        "",
        topology_table(results),
        "",
    ]
    (out / "planner.md").write_text("\n".join(md))
    return data


def display_name(model_dir: Path) -> str:
    return "SmolLM2-135M-Instruct" if model_dir.name.startswith("smollm2") else model_dir.name


def resolve_model(name: str) -> Path:
    """``smollm2``: the converted SmolLM2-135M (float32, cached under .models/)."""
    if name != "smollm2":
        return Path(name)
    return smollm2_dir()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.planner", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2", help="smollm2 (default) or a model directory (HF layout)")
    parser.add_argument("--rounds", type=int, default=3, help="calibrate + measure rounds per layout (median)")
    parser.add_argument("--decode-tokens", type=int, default=32, help="tokens generated per request")
    parser.add_argument("--requests", type=int, default=2, help="measured requests per round")
    parser.add_argument("--results", type=Path, default=RESULTS)
    args = parser.parse_args(argv)

    model_dir = resolve_model(args.model)
    busy = host_busy_fraction(2.0)
    if busy > 0.25:
        print(f"warning: the CPUs are {busy:.0%} busy with other work; the figures will be noisy", file=sys.stderr)
    results = compare(model_dir, rounds=args.rounds, decode_tokens=args.decode_tokens, requests=args.requests,
                      log=sys.stderr)
    write_results(results, model_dir, args.results, rounds=args.rounds, decode_tokens=args.decode_tokens,
                  requests=args.requests, busy_before=busy)
    print(f"{'layout':<10} {'predicted':>11} {'measured':>11} {'error':>8}")
    for r in results:
        print(f"TP{r.tp}/PP{r.pp:<5} {r.predicted_s * 1e3:9.1f} ms {r.measured_s * 1e3:9.1f} ms {r.error:+8.1%}")
    print(f"wrote {args.results / 'planner.json'} and {args.results / 'planner.md'}")
    return 0 if all(r.within_tolerance for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
