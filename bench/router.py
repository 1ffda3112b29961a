"""Router benchmark: what the router adds to a token stream, and what one routing decision costs.

``python -m bench.router [--model tiny|smollm2|DIR] [--streams 16] [--max-tokens 128] [--rounds 8]``
(also ``shardline bench router ...``).

Side by side in one run, same machine, same worker, same requests: N concurrent greedy streams
(``ignore_eos``, fixed prompt ids) sent straight to the worker's ``WorkerService.Generate`` (one
call per stream), straight to the worker on one ``WorkerService.Relay`` stream (one message per
engine step for all of them: what the router sends), and through the router's
``RouterService.Generate`` (which the router carries on its Relay stream to the worker), in
rounds whose order rotates so that drift in the machine's load hits all alike. Per request, TPOT
= (last token − first token) / (tokens − 1); per token, the inter-token latency (ITL). Reported:
p50/p99 of both per path, the router's added TPOT (routed − direct at the same percentile, the
target's measure against Generate, and against the direct Relay client), streamed tokens/s per
path, and the router process's CPU time per streamed token. The unit-level part times
``Router.try_reserve`` + ``release`` and a full ``AdmissionQueue.admit`` over 4, 16 and 64 groups.

Writes ``bench/results/router.json`` and ``bench/results/router.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from services.cli.up import resolve_model  # makes tiny / smollm2 if missing
from services.common.group_status import GroupStatus
from services.common.healthcheck import wait_serving as wait
from services.common.ports import free_port
from services.common.proto import common_pb2, router_pb2, router_pb2_grpc, worker_pb2, worker_pb2_grpc
from services.router.admission import AdmissionQueue
from services.router.replicas import ReplicaGroupView, ReplicaSet
from services.router.routing import Router

RESULTS = Path(__file__).resolve().parent / "results"
REPO = Path(__file__).resolve().parents[1]
TARGET_P50_MS = 1.0
TARGET_P99_MS = 3.0


@dataclass
class StreamTimes:
    arrivals: list[float] = field(default_factory=list)
    start: float = 0.0

    @property
    def tpot_s(self) -> float:
        return (self.arrivals[-1] - self.arrivals[0]) / (len(self.arrivals) - 1)

    @property
    def itl_s(self) -> list[float]:
        return [b - a for a, b in zip(self.arrivals, self.arrivals[1:])]


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    k = (len(ordered) - 1) * q / 100
    lo, hi = int(k), min(int(k) + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def prompt_ids(i: int, prompt_len: int) -> list[int]:
    return [(7 * i + j) % 250 + 4 for j in range(prompt_len)]


def greedy(max_tokens: int) -> common_pb2.SamplingParameters:
    return common_pb2.SamplingParameters(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def run_round(call, n_streams: int, prompt_len: int, max_tokens: int) -> tuple[list[StreamTimes], float]:
    """``n_streams`` concurrent streams through ``call(ids, sampling)``; (times, wall seconds)."""
    barrier = threading.Barrier(n_streams + 1)
    results = [StreamTimes() for _ in range(n_streams)]
    errors: list[BaseException] = []

    def one(i: int) -> None:
        ids = prompt_ids(i, prompt_len)
        sampling = greedy(max_tokens)
        times = results[i]
        barrier.wait()
        times.start = time.perf_counter()
        try:
            for response in call(ids, sampling):
                if response.HasField("token"):
                    times.arrivals.append(time.perf_counter())
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n_streams)]
    for t in threads:
        t.start()
    barrier.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    if errors:
        raise RuntimeError(f"{len(errors)} streams failed: {errors[0]}")
    assert all(len(r.arrivals) == max_tokens for r in results)
    return results, wall


def relay_round(stub, n_streams: int, prompt_len: int, max_tokens: int) -> tuple[list[StreamTimes], float]:
    """The same streams as one client's ``WorkerService.Relay`` stream straight to the worker (what
    the router sends); a token's arrival is that of the message carrying it."""
    submits = [worker_pb2.RelayRequest(submit=worker_pb2.RelaySubmit(relay_id=i, request=worker_pb2.GenerateRequest(
        token_ids=common_pb2.TokenIds(ids=prompt_ids(i, prompt_len)), sampling=greedy(max_tokens))))
        for i in range(n_streams)]
    results = [StreamTimes() for _ in range(n_streams)]
    t0 = time.perf_counter()
    for times in results:
        times.start = t0
    for response in stub.Relay(iter(submits)):  # half-closed after the submits: ends with the requests
        now = time.perf_counter()
        for event in response.events:
            if event.HasField("token"):
                results[event.relay_id].arrivals.append(now)
            elif event.HasField("error"):
                raise RuntimeError(f"relayed stream {event.relay_id} failed: {event.error.message}")
    wall = time.perf_counter() - t0
    assert all(len(r.arrivals) == max_tokens for r in results)
    return results, wall


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def routing_decision_us(n_groups: int, repeats: int = 4_000, trials: int = 5) -> dict[str, float]:
    """Microseconds per reserve+release and per admit+release over ``n_groups`` healthy groups
    (best of ``trials`` runs of ``repeats``: the machine is shared, the minimum is the cost)."""
    replicas = ReplicaSet()
    for i in range(n_groups):
        view = ReplicaGroupView(address=f"10.0.0.{i}:50052", replica_group_id=f"rg-{i:03d}", model="m",
                                kv_bytes_used=(i * 7919) % 1000 * 40_960, kv_bytes_capacity=524_288 * 40_960,
                                kv_bytes_per_token=40_960, max_model_len=8192, status=GroupStatus.HEALTHY)
        replicas._views[view.address] = view
    router = Router(replicas)
    admission = AdmissionQueue(replicas, router)
    out = {}
    for name, reserve in (("reserve_release_us", lambda: router.try_reserve("m", 512, 256)),
                          ("admit_release_us", lambda: admission.admit("m", 512, 256, max_model_len=8192))):
        for _ in range(500):
            router.release(reserve())
        best = float("inf")
        for _ in range(trials):
            t0 = time.perf_counter()
            for _ in range(repeats):
                router.release(reserve())
            best = min(best, (time.perf_counter() - t0) / repeats * 1e6)
        out[name] = best
    return out



def start(argv: list[str], log: Path):
    with log.open("wb") as out:
        return subprocess.Popen([sys.executable, "-m", "services.cli", *argv], cwd=REPO, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)


def wait_serving(proc, address: str, log: Path, timeout_s: float = 300) -> None:
    problem = wait(proc, address, timeout_s=timeout_s)
    if problem:
        raise RuntimeError(f"{problem}:\n{log.read_text()[-3000:]}")


def summarize(rounds: list[list[StreamTimes]], walls: list[float], tokens_per_round: int) -> dict[str, Any]:
    streams = [s for r in rounds for s in r]
    tpot = [s.tpot_s * 1e3 for s in streams]
    itl = [g * 1e3 for s in streams for g in s.itl_s]
    ttft = [(s.arrivals[0] - s.start) * 1e3 for s in streams]
    return {
        "tpot_ms": {"p50": percentile(tpot, 50), "p99": percentile(tpot, 99), "mean": statistics.fmean(tpot)},
        "itl_ms": {"p50": percentile(itl, 50), "p99": percentile(itl, 99)},
        "ttft_ms": {"p50": percentile(ttft, 50), "p99": percentile(ttft, 99)},
        "tokens_per_s": tokens_per_round * len(walls) / sum(walls),
        "requests": len(streams),
    }


def added_over(summaries: dict[str, dict[str, Any]], rounds: dict[str, list[list[StreamTimes]]],
               baseline: str) -> dict[str, Any]:
    """What the routed path adds over ``baseline``: the difference of each percentile, and paired
    (each round's routed TPOT p50 minus the baseline's of the same round), median over rounds."""
    b, t = summaries[baseline], summaries["routed"]
    per_round = [percentile([s.tpot_s * 1e3 for s in r], 50) - percentile([s.tpot_s * 1e3 for s in d], 50)
                 for r, d in zip(rounds["routed"], rounds[baseline], strict=True)]
    return {
        "tpot_p50_ms": t["tpot_ms"]["p50"] - b["tpot_ms"]["p50"],
        "tpot_p99_ms": t["tpot_ms"]["p99"] - b["tpot_ms"]["p99"],
        "itl_p50_ms": t["itl_ms"]["p50"] - b["itl_ms"]["p50"],
        "itl_p99_ms": t["itl_ms"]["p99"] - b["itl_ms"]["p99"],
        "ttft_p50_ms": t["ttft_ms"]["p50"] - b["ttft_ms"]["p50"],
        "tpot_p50_paired_ms": statistics.median(per_round),
        "tpot_p50_per_round_ms": per_round,
    }


def markdown(r: dict[str, Any]) -> str:
    d, q, t, a, b = r["direct"], r["direct_relay"], r["routed"], r["added"], r["added_vs_relay"]
    ok = "meets" if r["meets_target"] else "misses"

    def row(label: str, key: str, pct: str, fmt: str, unit: str) -> str:
        cells = [f"{x[key][pct]:{fmt}} {unit}" for x in (d, q, t)]
        added = [f"{x[f'{key[:-3]}_{pct}_ms']:+{fmt}} {unit}" for x in (a, b)]
        return f"| {label} | {' | '.join(cells + added)} |"

    lines = [
        "# Router benchmark",
        "",
        f"Model: {r['model']} on one worker (TP{r['tp']}/PP{r['pp']}, {r['dtype']}); {r['streams']} concurrent greedy "
        f"streams of {r['max_tokens']} tokens (prompt {r['prompt_tokens']} tokens, ignore_eos), {r['rounds']} rounds "
        f"per path, the paths' order rotating. Paths: straight to the worker, one `WorkerService.Generate` call "
        f"per stream (one message per token); straight to the worker on one `WorkerService.Relay` stream (one "
        f"message per engine step for all streams, what the router sends); through the router, "
        f"`RouterService.Generate`, which the router carries on its Relay stream to the worker. Machine: "
        f"{r['machine']['cpus']} CPUs, {r['machine']['platform']}; worker, router and client share them (1-minute "
        f"load average {r['machine']['load_avg_1m_before']:.1f} before the run, "
        f"{r['machine']['load_avg_1m_after']:.1f} after).",
        "",
        "| measure | straight, Generate | straight, Relay | through the router | added (vs Generate) | "
        "added (vs Relay) |",
        "|---|---|---|---|---|---|",
        row("TPOT p50", "tpot_ms", "p50", ".2f", "ms"),
        row("TPOT p99", "tpot_ms", "p99", ".2f", "ms"),
        row("inter-token latency p50", "itl_ms", "p50", ".2f", "ms"),
        row("inter-token latency p99", "itl_ms", "p99", ".2f", "ms"),
        row("time to first token p50", "ttft_ms", "p50", ".1f", "ms"),
        f"| streamed tokens/s | {d['tokens_per_s']:,.0f} | {q['tokens_per_s']:,.0f} | {t['tokens_per_s']:,.0f} | "
        f"ratio {t['tokens_per_s'] / d['tokens_per_s']:.3f} | ratio {t['tokens_per_s'] / q['tokens_per_s']:.3f} |",
        "",
        f"Target: added TPOT (vs Generate) p50 ≤ {TARGET_P50_MS:g} ms and p99 ≤ {TARGET_P99_MS:g} ms at "
        f"{r['streams']} streams: this run {ok} it. Router CPU: {r['router_cpu_us_per_token']:.0f} µs per streamed "
        f"token ({r['router_cpu_s']:.2f} s over {r['routed_tokens']:,} tokens).",
        "",
        f"Paired by round (each round's routed TPOT p50 minus the other path's of the same round): median "
        f"{a['tpot_p50_paired_ms']:+.2f} ms vs Generate (per round "
        + ", ".join(f"{x:+.2f}" for x in a["tpot_p50_per_round_ms"]) + f" ms), {b['tpot_p50_paired_ms']:+.2f} ms "
        "vs Relay (per round " + ", ".join(f"{x:+.2f}" for x in b["tpot_p50_per_round_ms"]) + " ms).",
        "",
        "On a machine where the worker, the router and the client threads share the CPUs, every "
        "microsecond spent relaying a token is taken from the worker's next step, so the added TPOT "
        "measures that contention. Per-request Generate calls cost the worker a message and a handler "
        "thread's wake-up per token per stream, a Relay stream one message per step, so the routed path "
        "can beat the direct Generate one. The direct Relay client is also the cheapest client (one thread "
        "reading one message per step, where the other two paths' clients read one message per token on a "
        "thread per stream), so the column against it counts the router plus that client difference. The "
        "router's per-token CPU is the figure that carries to machines where the router has a core of its "
        "own (where a relay adds latency to each token but not to the interval between tokens).",
        "",
        "| routing decision (unit level) | 4 groups | 16 groups | 64 groups |",
        "|---|---|---|---|",
    ]
    for key, label in (("reserve_release_us", "`Router.try_reserve` + `release`"),
                       ("admit_release_us", "`AdmissionQueue.admit` + `release`")):
        cells = " | ".join(f"{r['decision'][str(n)][key]:.1f} µs" for n in (4, 16, 64))
        lines.append(f"| {label} | {cells} |")
    lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.router", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny", help="tiny | smollm2 | a model directory (default tiny)")
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=8, help="rounds per path (default 8)")
    parser.add_argument("--results", type=Path, default=RESULTS)
    args = parser.parse_args(argv)


    load_before = os.getloadavg()
    workdir = Path(tempfile.mkdtemp(prefix="bench-router-"))
    model_dir = resolve_model(args.model)
    worker_port, router_port = free_port(), free_port()
    worker_addr, router_addr = f"127.0.0.1:{worker_port}", f"127.0.0.1:{router_port}"
    kv_gb = max(0.05, args.streams * (args.prompt_tokens + args.max_tokens) * 2 * 1e6 / 2**30)
    procs = []
    try:
        worker = start(["serve", "worker", "--model", str(model_dir), "--port", str(worker_port), "--tp", str(args.tp),
                        "--pp", str(args.pp), "--dtype", args.dtype, "--kv-cache-gb", f"{kv_gb:.3f}",
                        "--log-level", "WARNING"], workdir / "worker.log")
        procs.append(worker)
        wait_serving(worker, worker_addr, workdir / "worker.log")
        router = start(["serve", "router", "--model", str(model_dir), "--port", str(router_port), "--worker",
                        worker_addr, "--http-port", "-1", "--log-level", "WARNING"], workdir / "router.log")
        procs.append(router)
        wait_serving(router, router_addr, workdir / "router.log", timeout_s=60)
        worker_stub = worker_pb2_grpc.WorkerServiceStub(grpc.insecure_channel(worker_addr))
        router_stub = router_pb2_grpc.RouterServiceStub(grpc.insecure_channel(router_addr))

        def direct(ids, sampling):
            return worker_stub.Generate(worker_pb2.GenerateRequest(token_ids=common_pb2.TokenIds(ids=ids),
                                                                   sampling=sampling))

        def routed(ids, sampling):
            return router_stub.Generate(router_pb2.RouterGenerateRequest(token_ids=common_pb2.TokenIds(ids=ids),
                                                                         sampling=sampling))

        paths = {"direct": lambda n: run_round(direct, args.streams, args.prompt_tokens, n),
                 "relay": lambda n: relay_round(worker_stub, args.streams, args.prompt_tokens, n),
                 "routed": lambda n: run_round(routed, args.streams, args.prompt_tokens, n)}
        for path in paths.values():  # warm-up
            path(8)
        rounds: dict[str, list] = {name: [] for name in paths}
        walls: dict[str, list[float]] = {name: [] for name in paths}
        router_cpu = 0.0
        for i in range(args.rounds):
            names = list(paths)
            for name in names[i % 3:] + names[:i % 3]:  # each path first, second and last in turn
                before = cpu_seconds(router.pid)
                times, wall = paths[name](args.max_tokens)
                if name == "routed":
                    router_cpu += cpu_seconds(router.pid) - before
                rounds[name].append(times)
                walls[name].append(wall)
                print(f"round {i + 1} {name:<6}: {args.streams * args.max_tokens / wall:,.0f} tok/s, "
                      f"TPOT p50 {percentile([s.tpot_s * 1e3 for s in times], 50):.2f} ms", flush=True)
    finally:
        for proc in reversed(procs):
            proc.terminate()
            try:
                proc.wait(timeout=20)
            except Exception:  # noqa: BLE001
                proc.kill()

    tokens_per_round = args.streams * args.max_tokens
    summaries = {name: summarize(rounds[name], walls[name], tokens_per_round) for name in rounds}
    direct_s, relay_s, routed_s = summaries["direct"], summaries["relay"], summaries["routed"]
    added, added_vs_relay = added_over(summaries, rounds, "direct"), added_over(summaries, rounds, "relay")
    routed_tokens = tokens_per_round * args.rounds
    result = {
        "model": str(args.model), "tp": args.tp, "pp": args.pp, "dtype": args.dtype, "streams": args.streams,
        "prompt_tokens": args.prompt_tokens, "max_tokens": args.max_tokens, "rounds": args.rounds,
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
                    "load_avg_1m_before": load_before[0], "load_avg_1m_after": os.getloadavg()[0]},
        "direct": direct_s, "direct_relay": relay_s, "routed": routed_s, "added": added,
        "added_vs_relay": added_vs_relay,
        "meets_target": added["tpot_p50_ms"] <= TARGET_P50_MS and added["tpot_p99_ms"] <= TARGET_P99_MS,
        "router_cpu_s": router_cpu, "routed_tokens": routed_tokens,
        "router_cpu_us_per_token": router_cpu / routed_tokens * 1e6,
        "decision": {str(n): routing_decision_us(n) for n in (4, 16, 64)},
    }
    args.results.mkdir(parents=True, exist_ok=True)
    (args.results / "router.json").write_text(json.dumps(result, indent=2) + "\n")
    (args.results / "router.md").write_text(markdown(result))
    print(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
