"""Router benchmark: what the router adds to a token stream, and what one routing decision costs.

``python -m bench.router [--model tiny|smollm2|DIR] [--streams 16] [--max-tokens 128] [--rounds 8]``
(also ``shardline bench router ...``).

Side by side in one run, same machine, same worker, same requests: N concurrent greedy streams
(``ignore_eos``, fixed prompt ids) sent straight to the worker's ``WorkerService.Generate`` and
through the router's ``RouterService.Generate``, in alternating rounds so that drift in the
machine's load hits both alike. Per request, TPOT = (last token − first token) / (tokens − 1);
per token, the inter-token latency (ITL). Reported: p50/p99 of both per path, the router's
added TPOT (routed − direct at the same percentile), streamed tokens/s per path, and the router
process's CPU time per streamed token. The unit-level part times ``Router.try_reserve`` +
``release`` and a full ``AdmissionQueue.admit`` over 4, 16 and 64 groups.

Writes ``bench/results/router.json`` and ``bench/results/router.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from services.common.proto import common_pb2, router_pb2, router_pb2_grpc, worker_pb2, worker_pb2_grpc

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


def run_round(call, n_streams: int, prompt_len: int, max_tokens: int) -> tuple[list[StreamTimes], float]:
    """``n_streams`` concurrent streams through ``call(ids, sampling)``; (times, wall seconds)."""
    barrier = threading.Barrier(n_streams + 1)
    results = [StreamTimes() for _ in range(n_streams)]
    errors: list[BaseException] = []

    def one(i: int) -> None:
        ids = [(7 * i + j) % 250 + 4 for j in range(prompt_len)]
        sampling = common_pb2.SamplingParameters(temperature=0, max_tokens=max_tokens, ignore_eos=True)
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


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def routing_decision_us(n_groups: int, repeats: int = 4_000, trials: int = 5) -> dict[str, float]:
    """Microseconds per reserve+release and per admit+release over ``n_groups`` healthy groups
    (best of ``trials`` runs of ``repeats``: the machine is shared, the minimum is the cost)."""
    from services.router.admission import AdmissionQueue
    from services.router.replicas import GroupStatus, ReplicaGroupView, ReplicaSet
    from services.router.routing import Router

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


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start(argv: list[str], log: Path):
    import subprocess

    with log.open("wb") as out:
        return subprocess.Popen([sys.executable, "-m", "services.cli", *argv], cwd=REPO, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)


def wait_serving(proc, address: str, log: Path, timeout_s: float = 300) -> None:
    from services.common.healthcheck import wait_serving as wait

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


def markdown(r: dict[str, Any]) -> str:
    d, t, a = r["direct"], r["routed"], r["added"]
    ok = "meets" if r["meets_target"] else "misses"
    lines = [
        "# Router benchmark",
        "",
        f"Model: {r['model']} on one worker (TP{r['tp']}/PP{r['pp']}, {r['dtype']}); {r['streams']} concurrent greedy "
        f"streams of {r['max_tokens']} tokens (prompt {r['prompt_tokens']} tokens, ignore_eos), {r['rounds']} rounds "
        f"per path, alternating. Machine: {r['machine']['cpus']} CPUs, {r['machine']['platform']}; worker, router "
        f"and client share them (1-minute load average {r['machine']['load_avg_1m_before']:.1f} before the run, "
        f"{r['machine']['load_avg_1m_after']:.1f} after).",
        "",
        "| measure | straight to the worker | through the router | added by the router |",
        "|---|---|---|---|",
        f"| TPOT p50 | {d['tpot_ms']['p50']:.2f} ms | {t['tpot_ms']['p50']:.2f} ms | {a['tpot_p50_ms']:+.2f} ms |",
        f"| TPOT p99 | {d['tpot_ms']['p99']:.2f} ms | {t['tpot_ms']['p99']:.2f} ms | {a['tpot_p99_ms']:+.2f} ms |",
        f"| inter-token latency p50 | {d['itl_ms']['p50']:.2f} ms | {t['itl_ms']['p50']:.2f} ms | "
        f"{a['itl_p50_ms']:+.2f} ms |",
        f"| inter-token latency p99 | {d['itl_ms']['p99']:.2f} ms | {t['itl_ms']['p99']:.2f} ms | "
        f"{a['itl_p99_ms']:+.2f} ms |",
        f"| time to first token p50 | {d['ttft_ms']['p50']:.1f} ms | {t['ttft_ms']['p50']:.1f} ms | "
        f"{a['ttft_p50_ms']:+.1f} ms |",
        f"| streamed tokens/s | {d['tokens_per_s']:,.0f} | {t['tokens_per_s']:,.0f} | "
        f"ratio {t['tokens_per_s'] / d['tokens_per_s']:.3f} |",
        "",
        f"Target: added TPOT p50 ≤ {TARGET_P50_MS:g} ms and p99 ≤ {TARGET_P99_MS:g} ms at {r['streams']} streams: "
        f"this run {ok} it. Router CPU: {r['router_cpu_us_per_token']:.0f} µs per streamed token "
        f"({r['router_cpu_s']:.2f} s over {r['routed_tokens']:,} tokens).",
        "",
        f"Paired by round (each round's routed TPOT p50 minus the direct one run next to it): median "
        f"{a['tpot_p50_paired_ms']:+.2f} ms; per round "
        + ", ".join(f"{x:+.2f}" for x in a["tpot_p50_per_round_ms"]) + " ms.",
        "",
        "On a machine where the worker, the router and the client threads share the CPUs, every "
        "microsecond the router spends relaying a token is taken from the worker's next step, so the added "
        "TPOT measures that contention; the router's own per-token CPU cost is the figure that carries to "
        "machines where the router has a core of its own (where a relay adds latency to each token but "
        "not to the interval between tokens).",
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

    from services.cli.up import resolve_model  # tiny / smollm2 are made under .models/ if missing

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

        run_round(direct, args.streams, args.prompt_tokens, 8)  # warm-up, both paths
        run_round(routed, args.streams, args.prompt_tokens, 8)
        rounds: dict[str, list] = {"direct": [], "routed": []}
        walls: dict[str, list[float]] = {"direct": [], "routed": []}
        router_cpu = 0.0
        for i in range(args.rounds):
            for name, call in (("direct", direct), ("routed", routed)) if i % 2 == 0 else \
                    (("routed", routed), ("direct", direct)):
                before = cpu_seconds(router.pid)
                times, wall = run_round(call, args.streams, args.prompt_tokens, args.max_tokens)
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
    direct_s = summarize(rounds["direct"], walls["direct"], tokens_per_round)
    routed_s = summarize(rounds["routed"], walls["routed"], tokens_per_round)
    added = {
        "tpot_p50_ms": routed_s["tpot_ms"]["p50"] - direct_s["tpot_ms"]["p50"],
        "tpot_p99_ms": routed_s["tpot_ms"]["p99"] - direct_s["tpot_ms"]["p99"],
        "itl_p50_ms": routed_s["itl_ms"]["p50"] - direct_s["itl_ms"]["p50"],
        "itl_p99_ms": routed_s["itl_ms"]["p99"] - direct_s["itl_ms"]["p99"],
        "ttft_p50_ms": routed_s["ttft_ms"]["p50"] - direct_s["ttft_ms"]["p50"],
    }
    # paired: round i's routed p50 minus round i's direct p50 (run back to back), median over rounds
    per_round = [percentile([s.tpot_s * 1e3 for s in r], 50) - percentile([s.tpot_s * 1e3 for s in d], 50)
                 for r, d in zip(rounds["routed"], rounds["direct"], strict=True)]
    added["tpot_p50_paired_ms"] = statistics.median(per_round)
    added["tpot_p50_per_round_ms"] = per_round
    routed_tokens = tokens_per_round * args.rounds
    result = {
        "model": str(args.model), "tp": args.tp, "pp": args.pp, "dtype": args.dtype, "streams": args.streams,
        "prompt_tokens": args.prompt_tokens, "max_tokens": args.max_tokens, "rounds": args.rounds,
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
                    "load_avg_1m_before": load_before[0], "load_avg_1m_after": os.getloadavg()[0]},
        "direct": direct_s, "routed": routed_s, "added": added,
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
