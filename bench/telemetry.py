"""Telemetry benchmark: ingest rate on one core, memory per series, and the forward pass's cost
of recording and shipping collective events. ``python -m bench.telemetry [--quick]``.

Side by side in one run, on this machine:

* ingest — CollectiveEvents per second through the telemetry pipeline with window aggregation
  on (windows, histograms, exported totals, timeout rule), on one core: (a) in-process, protobuf
  parse + ingest of 1,000-event ``ReportRequest`` batches, the process pinned to one CPU; (b) over
  gRPC into a ``shardline serve telemetry`` process pinned to one CPU, the senders pinned to
  another, as events per wall second and per second of the server's own CPU time.
* memory — bytes per tracked (replica_group_id, gpu_id, op_type) series holding its full set of
  retained windows, from ``tracemalloc``.
* step overhead — a TP2 tiny-model engine decoding a batch, alternating phases with the
  coordinator's events shipped to a live telemetry process (on) and discarded at the sink (off),
  in ABBA order so drift cancels; the same ranks, the same sequences, one run.

Writes ``bench/results/telemetry.json`` and ``bench/results/telemetry.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import tracemalloc
from pathlib import Path
from typing import Any

import grpc
import torch
import torch.multiprocessing as mp

from services.common.collective_events import CollectiveEvent
from services.common.healthcheck import wait_serving
from services.common.ports import free_port
from services.common.proto import telemetry_pb2
from services.common.sampling import SamplingParams
from services.modeling.tiny import TinyModelSpec, write_tiny_model
from services.telemetry.client import ShipperConfig, TelemetryShipper
from services.telemetry.pipeline import TelemetryPipeline
from services.telemetry.windows import WindowConfig, WindowStore
from services.worker.engine.bootstrap import build_engine, start_rank
from services.worker.engine.runner import follower_loop
from services.worker.launch import run_replica_group
from services.worker.runtime import RankSpec

RESULTS = Path(__file__).resolve().parent / "results"
REPO = Path(__file__).resolve().parents[1]
OPS = ("all_reduce", "all_gather", "broadcast", "send", "recv")


# -- synthetic traffic -----------------------------------------------------------------------------

def synthetic_batches(n_batches: int, *, batch: int = 1000, groups: int = 4, ranks: int = 8,
                      seed: int = 0) -> list[bytes]:
    """Serialized ReportRequests as ranks send them: each batch from one rank, a mix of ops with
    log-normal durations, timestamps now."""
    rng = random.Random(seed)
    now = int(time.time() * 1e3)
    out = []
    for b in range(n_batches):
        group = f"rg-bench-{b % groups}"
        gpu = f"{group}:pp{(b // groups) % 2}-tp{(b // (2 * groups)) % (ranks // 2)}"
        events = [telemetry_pb2.CollectiveEvent(
            replica_group_id=group, gpu_id=gpu, op_type=OPS[i % len(OPS)], bytes=rng.choice((8, 4096, 65536)),
            duration_ms=rng.lognormvariate(-2.0, 0.8), group_size=2, timestamp_ms=now + i // 50, timed_out=False)
            for i in range(batch)]
        out.append(telemetry_pb2.ReportRequest(events=events).SerializeToString())
    return out


def pin(cpus: set[int]) -> None:
    try:
        os.sched_setaffinity(0, cpus)
    except (AttributeError, OSError):  # pragma: no cover - not Linux
        pass


def cpus() -> list[int]:
    try:
        return sorted(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover
        return list(range(os.cpu_count() or 1))


# -- ingest ----------------------------------------------------------------------------------------

def ingest_in_process(payloads: list[bytes], seconds: float) -> dict[str, Any]:
    pipeline = TelemetryPipeline()
    parse = telemetry_pb2.ReportRequest.FromString
    events = 0
    t0 = time.perf_counter()
    c0 = time.process_time()
    while time.perf_counter() - t0 < seconds:
        for payload in payloads:
            events += pipeline.ingest(parse(payload).events)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    pipeline.tick()
    return {"events": events, "seconds": wall, "cpu_seconds": cpu, "events_per_s": events / wall,
            "events_per_cpu_s": events / cpu, "series": len(pipeline.store.series)}


def _proc_cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")



def start_telemetry(log: Path, *flags: str, cpu: int | None = None) -> tuple[subprocess.Popen, str]:
    port = free_port()
    preexec = (lambda: os.sched_setaffinity(0, {cpu})) if cpu is not None else None
    with log.open("wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "services.cli", "serve", "telemetry", "--port", str(port),
                                 "--log-level", "WARNING", *flags], cwd=REPO, stdout=out, stderr=subprocess.STDOUT,
                                preexec_fn=preexec)
    address = f"127.0.0.1:{port}"
    problem = wait_serving(proc, address, timeout_s=60)
    if problem:
        proc.kill()
        raise RuntimeError(f"telemetry: {problem}:\n{log.read_text()}")
    return proc, address


def ingest_over_grpc(payloads: list[bytes], seconds: float, workdir: Path, *, streams: int = 2) -> dict[str, Any]:
    all_cpus = cpus()
    server_cpu = all_cpus[0]
    client_cpus = set(all_cpus[1:]) or {server_cpu}
    proc, address = start_telemetry(workdir / "ingest.log", cpu=server_cpu)
    pin(client_cpus)
    accepted = [0] * streams
    try:
        channel = grpc.insecure_channel(address)
        report = channel.stream_unary("/shardline.v1.TelemetryService/Report", request_serializer=None,
                                      response_deserializer=telemetry_pb2.ReportResponse.FromString)
        deadline = time.monotonic() + seconds

        def requests():
            while time.monotonic() < deadline:
                yield from payloads

        def sender(k: int) -> None:
            accepted[k] = report(requests(), timeout=seconds + 60).accepted

        threads = [threading.Thread(target=sender, args=(k,)) for k in range(streams)]
        cpu0, t0 = _proc_cpu_s(proc.pid), time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall, server_cpu_s = time.perf_counter() - t0, _proc_cpu_s(proc.pid) - cpu0
        channel.close()
    finally:
        pin(set(all_cpus))
        proc.terminate()
        proc.wait(timeout=30)
    events = sum(accepted)
    return {"events": events, "seconds": wall, "server_cpu_seconds": server_cpu_s, "events_per_s": events / wall,
            "events_per_server_cpu_s": events / server_cpu_s, "streams": streams, "server_cpu": server_cpu,
            "client_cpus": sorted(client_cpus)}


# -- memory ----------------------------------------------------------------------------------------

def memory_per_series(series: int, events_per_window: int, retain: int) -> dict[str, Any]:
    rng = random.Random(1)
    origin = 1_700_000_000_000
    config = WindowConfig(window_s=10.0, retain_windows=retain)
    events = [CollectiveEvent(f"rg-{s // 64}", f"rg-{s // 64}:pp{s % 8}-tp{(s // 8) % 8}", "all_reduce", 4096,
                              rng.lognormvariate(-2.0, 0.8), 8, origin + w * 10_000 + i, False)
              for w in range(retain) for s in range(series) for i in range(events_per_window)]
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    store = WindowStore(config, now_ms=origin)
    store.add_many(events)
    after = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    buckets = sum(len(w.durations.buckets) for s in store.series.values() for w in s.windows.values())
    per_series = (after - before) / series
    return {"series": series, "windows_per_series": retain, "events_per_window": events_per_window,
            "bytes_per_series": per_series, "bytes_per_window": per_series / retain,
            "histogram_buckets_per_window": buckets / (series * retain)}


# -- step overhead ---------------------------------------------------------------------------------

class ToggleSink:
    """Forwards to the shipper while ``flag`` is set, discards otherwise (telemetry off)."""

    def __init__(self, inner, flag) -> None:
        self.inner = inner
        self.flag = flag

    def record(self, event) -> None:
        if self.flag.value:
            self.inner.record(event)


def abba(phases: int) -> list[bool]:
    """off, on, on, off, off, on, on, off, ...: linear drift cancels between the two."""
    return [(i % 4) in (1, 2) for i in range(phases)]


def overhead_rank(rank: int, world_size: int, spec, shipper_config, flag, batch: int, warmup: int, phases: int,
                  steps_per_phase: int):
    shipper = TelemetryShipper(shipper_config)
    sink = ToggleSink(shipper, flag)
    runner, layout = start_rank(spec, rank, sink=sink)
    if rank != 0:
        follower_loop(runner)
        shipper.close()
        return None
    engine = build_engine(spec, runner, layout)
    total = warmup + phases * steps_per_phase + 4
    rng = random.Random(0)
    vocab = runner.rt.plan.config.vocab_size
    for _ in range(batch):
        engine.submit([rng.randrange(vocab) for _ in range(16)],
                      SamplingParams(temperature=0.0, max_tokens=total, ignore_eos=True))
    flag.value = 1
    for _ in range(warmup):
        engine.step()
    phase_times: list[tuple[bool, list[float]]] = []
    skip = 1  # the first step of a phase may still see the previous phase's shipping
    for on in abba(phases):
        flag.value = 1 if on else 0
        start = len(engine.step_times_s)
        for _ in range(steps_per_phase):
            engine.step()
        phase_times.append((on, list(engine.step_times_s)[start + skip:]))
    flag.value = 1
    engine.shutdown()
    shipper.close(timeout_s=5)
    return {"phases": phase_times, "shipper": shipper.stats(), "events_per_step": _events_per_step(runner.rt.plan)}


def _events_per_step(plan) -> int:
    """Coordinator events one decode step records on the driver (TP only)."""
    layers = len(plan.stage_layers(0))
    return 2 + (2 * layers + 2 if plan.tp_degree > 1 else 0)


def shipper_cost(address: str, n: int = 100_000) -> dict[str, float]:
    """CPU per event of ``record`` (the forward pass's share) and of shipping it (the background
    thread's conversion, serialization and gRPC), measured on this process's CPU clock."""
    now = int(time.time() * 1e3)
    events = [CollectiveEvent("rg-cost", "rg-cost:pp0-tp0", OPS[i % len(OPS)], 4096, 0.05, 2, now, False)
              for i in range(n)]
    shipper = TelemetryShipper(ShipperConfig(address, buffer_events=2 * n))
    time.sleep(0.5)  # the first (empty) stream is open
    c0 = time.process_time()
    for e in events:
        shipper.record(e)
    c1 = time.process_time()
    shipper.close(timeout_s=60)
    c2 = time.process_time()
    assert shipper.accepted == n, shipper.stats()
    return {"record_us": (c1 - c0) / n * 1e6, "ship_us": (c2 - c1) / n * 1e6}


def paired_overhead(phases: list[tuple[bool, list[float]]], *, resamples: int = 2000) -> dict[str, Any]:
    """The overhead block by block: each ABBA block (off, on, on, off) gives median(on) / median(off)
    − 1 from steps a few hundred milliseconds apart, so the machine's slow drifts cancel inside a
    block; the figure is the median over blocks with a bootstrap 95 % interval (blocks resampled)."""
    ratios = []
    for i in range(0, len(phases) - 3, 4):
        block = phases[i:i + 4]
        on = [t for is_on, times in block if is_on for t in times]
        off = [t for is_on, times in block if not is_on for t in times]
        ratios.append(statistics.median(on) / statistics.median(off) - 1)
    rng = random.Random(0)
    medians = sorted(statistics.median(rng.choices(ratios, k=len(ratios))) for _ in range(resamples))
    return {"blocks": len(ratios), "median": statistics.median(ratios),
            "ci95": [medians[int(0.025 * resamples)], medians[int(0.975 * resamples) - 1]]}


def step_overhead(model_dir: str, workdir: Path, *, tp: int, batch: int, warmup: int, phases: int,
                  steps_per_phase: int) -> dict[str, Any]:
    proc, address = start_telemetry(workdir / "overhead.log")
    try:
        flag = mp.get_context("spawn").Value("b", 1, lock=False)
        spec = RankSpec(model_dir, tp_degree=tp, max_num_seqs=batch)
        out = run_replica_group(tp, overhead_rank, spec, ShipperConfig(address), flag, batch, warmup, phases,
                                steps_per_phase)
        cost = shipper_cost(address)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    on = [t for is_on, times in out["phases"] if is_on for t in times]
    off_phases = [times for is_on, times in out["phases"] if not is_on]
    off = [t for times in off_phases for t in times]
    # A/A control: the off phases come in pairs in ABBA order (one after an on phase, one after an
    # off phase); alternate pairs go to two halves, so comparing the halves, identical conditions,
    # shows this machine's noise floor
    off_a = [t for k, times in enumerate(off_phases) if (k + 1) // 2 % 2 == 0 for t in times]
    off_b = [t for k, times in enumerate(off_phases) if (k + 1) // 2 % 2 == 1 for t in times]
    med_on, med_off = statistics.median(on), statistics.median(off)
    mean_on, mean_off = statistics.fmean(on), statistics.fmean(off)
    return {"tp": tp, "batch": batch, "phases": phases, "steps_per_phase": steps_per_phase,
            "steps_on": len(on), "steps_off": len(off),
            "median_step_s": {"on": med_on, "off": med_off}, "mean_step_s": {"on": mean_on, "off": mean_off},
            "overhead_median": med_on / med_off - 1, "overhead_mean": mean_on / mean_off - 1,
            "off_vs_off_median": statistics.median(off_b) / statistics.median(off_a) - 1,
            "off_vs_off_mean": statistics.fmean(off_b) / statistics.fmean(off_a) - 1,
            "paired": paired_overhead(out["phases"]),
            "driver_events_per_step": out["events_per_step"], "driver_shipper": out["shipper"],
            "cost_per_event_us": cost,
            "estimated_overhead": out["events_per_step"] * (cost["record_us"] + cost["ship_us"]) / 1e6 / med_off}


# -- main ------------------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.telemetry", description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=8.0, help="length of each ingest measurement")
    parser.add_argument("--series", type=int, default=2000, help="series for the memory measurement")
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--batch", type=int, default=8, help="sequences decoding in the overhead run")
    parser.add_argument("--phases", type=int, default=320, help="ABBA phases (4 per block)")
    parser.add_argument("--steps-per-phase", type=int, default=6)
    parser.add_argument("--model", default=None, help="model directory (default: the tiny random Llama)")
    parser.add_argument("--quick", action="store_true", help="short run (smoke test)")
    parser.add_argument("--results", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    if args.quick:
        args.seconds, args.series, args.phases, args.steps_per_phase = 2.0, 200, 8, 8

    with tempfile.TemporaryDirectory(prefix="shardline-bench-telemetry-") as tmp:
        workdir = Path(tmp)
        payloads = synthetic_batches(64)
        all_cpus = cpus()
        pin({all_cpus[-1]})
        in_process = ingest_in_process(payloads, args.seconds)
        pin(set(all_cpus))
        over_grpc = ingest_over_grpc(payloads, args.seconds, workdir)
        memory = memory_per_series(args.series, events_per_window=200, retain=6)
        model_dir = args.model
        if model_dir is None:
            model_dir = str(workdir / "tiny")
            write_tiny_model(TinyModelSpec(), Path(model_dir))
        overhead = step_overhead(model_dir, workdir, tp=args.tp, batch=args.batch, warmup=20, phases=args.phases,
                                 steps_per_phase=args.steps_per_phase)


    result = {
        "ingest_in_process": in_process,
        "ingest_grpc": over_grpc,
        "memory": memory,
        "step_overhead": overhead,
        "model": "tiny random Llama (4 layers, hidden 256, vocab 512), float32" if args.model is None else args.model,
        "targets": {"events_per_s_one_core": 50_000, "step_overhead": 0.03},
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__,
                    "platform": platform.platform()},
    }
    args.results.mkdir(parents=True, exist_ok=True)
    (args.results / "telemetry.json").write_text(json.dumps(result, indent=2) + "\n")
    (args.results / "telemetry.md").write_text(markdown(result))
    print(markdown(result))
    return 0


def markdown(r: dict[str, Any]) -> str:
    ip, g, m, o = r["ingest_in_process"], r["ingest_grpc"], r["memory"], r["step_overhead"]
    target = r["targets"]["events_per_s_one_core"]
    ms = lambda s: f"{s * 1e3:.2f} ms"  # noqa: E731
    return "\n".join([
        "# Telemetry benchmark",
        "",
        f"{r['machine']['cpus']} CPUs (shared), Python {r['machine']['python']}, torch {r['machine']['torch']}.",
        "",
        "## Ingest with window aggregation on, one core",
        "",
        "| path | events/s | target | ratio |",
        "|---|---|---|---|",
        f"| in-process: protobuf parse + windows + rules, pinned to one CPU | {ip['events_per_s']:,.0f} "
        f"| {target:,} | {ip['events_per_s'] / target:.1f}x |",
        f"| gRPC `Report` into `serve telemetry` pinned to one CPU (wall) | {g['events_per_s']:,.0f} "
        f"| {target:,} | {g['events_per_s'] / target:.1f}x |",
        f"| same, per second of the server's own CPU time | {g['events_per_server_cpu_s']:,.0f} "
        f"| {target:,} | {g['events_per_server_cpu_s'] / target:.1f}x |",
        "",
        f"Batches of 1,000 events from 64 synthetic ranks' batches ({ip['series']} series), {g['streams']} "
        f"concurrent streams, senders pinned to CPU(s) {g['client_cpus']}, server to CPU {g['server_cpu']}; "
        f"{g['events']:,} events in {g['seconds']:.1f} s over gRPC.",
        "",
        "## Memory per tracked series",
        "",
        "| series | windows kept | events per window | non-empty histogram buckets per window | bytes per series "
        "| per window |",
        "|---|---|---|---|---|---|",
        f"| {m['series']:,} | {m['windows_per_series']} | {m['events_per_window']} "
        f"| {m['histogram_buckets_per_window']:.0f} | {m['bytes_per_series']:,.0f} | {m['bytes_per_window']:,.0f} |",
        "",
        "## Engine step time, telemetry on vs off (same run)",
        "",
        "| | median step | mean step | steps |",
        "|---|---|---|---|",
        f"| off (events discarded at the sink) | {ms(o['median_step_s']['off'])} | {ms(o['mean_step_s']['off'])} "
        f"| {o['steps_off']} |",
        f"| on (shipped to a live telemetry process) | {ms(o['median_step_s']['on'])} | {ms(o['mean_step_s']['on'])} "
        f"| {o['steps_on']} |",
        f"| overhead, on vs off | {o['overhead_median']:+.1%} | {o['overhead_mean']:+.1%} | target <= "
        f"{r['targets']['step_overhead']:.0%} |",
        f"| noise floor: off vs off (A/A, alternate pairs of off phases) | {o['off_vs_off_median']:+.1%} "
        f"| {o['off_vs_off_mean']:+.1%} | |",
        "",
        f"Paired, block by block (each ABBA block's median on-step over its median off-step, steps a few hundred "
        f"ms apart so the machine's drift cancels): median over {o['paired']['blocks']} blocks "
        f"**{o['paired']['median']:+.2%}**, bootstrap 95 % interval [{o['paired']['ci95'][0]:+.2%}, "
        f"{o['paired']['ci95'][1]:+.2%}] (target <= {r['targets']['step_overhead']:.0%}).",
        "",
        f"CPU per event, measured alone: `record` {o['cost_per_event_us']['record_us']:.2f} µs (on the forward "
        f"pass), shipping {o['cost_per_event_us']['ship_us']:.2f} µs (background thread: protobuf, gRPC). At "
        f"{o['driver_events_per_step']} events per step that is {o['estimated_overhead']:.2%} of the median "
        "telemetry-off step, counting the background thread's CPU against the step as if no other core were "
        "free. On this shared machine the A/B medians move by more than that from run to run; this estimate "
        "bounds the cost by the CPU time actually spent.",
        "",
        f"TP{o['tp']} {r['model']}, {o['batch']} sequences decoding, {o['phases']} phases of "
        f"{o['steps_per_phase']} steps in ABBA order (first step of each phase not counted); the driver records "
        f"{o['driver_events_per_step']} events per step. Its shipper: {o['driver_shipper']}. The telemetry process "
        "shares this machine's CPUs with the ranks.",
        "",
    ])


if __name__ == "__main__":
    sys.exit(main())
