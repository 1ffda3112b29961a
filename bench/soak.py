"""Soak bench: the whole stack under many streams, bad input and dropped clients, for minutes.

``python -m bench.soak [--model tiny|smollm2|DIR] [--streams 64] [--duration 600]
[--malformed-share 0.1] [--cancel-share 0.1] [--out bench/results]``

Starts the stack as a user does (``shardline up --model ...`` on free ports, its own state and
log directory), waits until ``/health`` is 200, then runs ``--streams`` client loops for
``--duration`` seconds through the OpenAI HTTP API (``bench/_soak_clients.py``): normal streamed
completions and chats with the ``openai`` client, a share of malformed requests with ``httpx``
(bad JSON, wrong Content-Type, out-of-range fields, lone surrogates, null content, an oversize
body; each has the 4xx it must get) and a share of streams the client closes mid-stream.
Meanwhile it samples the RSS of every process of the stack (the process tree under the ``up``
pid: router, workers, their ranks, planner, loader, telemetry) every ``--sample-interval``
seconds. Recorded: requests by outcome and error class, 5xx (must be 0), unexpected stream
errors, p50/p99/max inter-token gap of the normal streams, tokens/s, RSS over time and its
growth per process (mean of the first minute vs the last; a quarter of the run when shorter
than four minutes).

Writes ``soak.json``, ``soak.md`` and ``soak-rss.png`` (with matplotlib) under ``--out``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import grpc
import httpx

from bench._soak_clients import Load, Stats
from bench._soak_report import markdown, plot_rss, verdict
from bench.common import wait_http_health
from services.common.config import child_environ
from services.common.ports import free_port_run
from services.common.process_names import rank_of_process
from services.common.proto import common_pb2, router_pb2, router_pb2_grpc, worker_pb2, worker_pb2_grpc

try:  # psutil reads the process tree and RSS; /proc does when it is not installed
    import psutil
except ImportError:  # pragma: no cover - the bench extra installs it
    psutil = None

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"
INTERNAL = ("telemetry", "loader", "planner")  # `up --port-base B` gives them B, B+1, B+2



def ports_for(port_base: int | None, replicas: int) -> dict[str, int]:
    """router, http and the internal base: consecutive from ``port_base``, else a run of free ports (the
    internal services take base .. base+2+replicas; a clash fails loudly, as `up` reports it)."""
    if port_base is not None:
        return {"router": port_base, "http": port_base + 1, "base": port_base + 2}
    start = free_port_run(2 + len(INTERNAL) + replicas)
    return {"router": start, "http": start + 1, "base": start + 2}


# --- the process tree -------------------------------------------------------------------------

def _children_proc() -> dict[int, list[int]]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry))
    return children


def descendants(root: int) -> list[int]:
    """``root`` and every process under it, parents first."""
    if psutil is not None:
        try:
            proc = psutil.Process(root)
            return [root, *(p.pid for p in proc.children(recursive=True))]
        except psutil.Error:
            return []
    children, out, todo = _children_proc(), [], [root]
    while todo:
        pid = todo.pop(0)
        out.append(pid)
        todo.extend(sorted(children.get(pid, [])))
    return out


def cmdline(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").rstrip("\0").split("\0")
    except OSError:
        return []


def ppid_of(pid: int) -> int:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return -1


def rss_bytes(pid: int) -> int | None:
    if psutil is not None:
        try:
            return psutil.Process(pid).memory_info().rss
        except psutil.Error:
            return None
    try:
        pages = int(Path(f"/proc/{pid}/statm").read_text().split()[1])
    except (OSError, IndexError, ValueError):
        return None
    return pages * os.sysconf("SC_PAGE_SIZE")


class ProcessSampler(threading.Thread):
    """Every ``interval_s``: the RSS of each process under ``root``, named by its role."""

    def __init__(self, root: int, ports: dict[str, int], interval_s: float) -> None:
        super().__init__(name="rss-sampler", daemon=True)
        self.root, self.interval_s = root, interval_s
        self.by_port = {str(ports["router"]): "router"}
        self.by_port.update({str(ports["base"] + i): name for i, name in enumerate(INTERNAL)})
        self.workers: dict[str, str] = {}  # replica group id -> worker-N, in the order they appear
        self.series: dict[int, dict[str, Any]] = {}  # pid -> {label, cmd, samples [[t, rss MiB]]}
        self.t0 = time.monotonic()
        self._halt = threading.Event()

    def label(self, pid: int, args: list[str]) -> str:
        if pid == self.root:
            return "up"
        rank = rank_of_process(pid)  # a rank forked from its worker shares the worker's command line
        if rank is not None:
            parent = self.series.get(ppid_of(pid))
            return f"{parent['label'] if parent else '?'}.rank{rank}"
        if "serve" in args and "worker" in args and "--replica-group-id" in args:
            group = args[args.index("--replica-group-id") + 1]
            return self.workers.setdefault(group, f"worker-{len(self.workers)}")
        if "serve" in args and "--port" in args:
            port = args[args.index("--port") + 1] if args.index("--port") + 1 < len(args) else ""
            return self.by_port.get(port, f"{args[args.index('serve') + 1]}:{port}")
        parent = self.series.get(ppid_of(pid))
        owner = parent["label"] if parent else "?"
        joined = " ".join(args)
        if "spawn_main" in joined:
            siblings = sum(1 for s in self.series.values() if s["label"].startswith(f"{owner}.rank"))
            return f"{owner}.rank{siblings}"
        if "resource_tracker" in joined:
            return f"{owner}.resource_tracker"
        return f"{owner}.{Path(args[0]).name if args else pid}"

    def sample(self) -> None:
        now = round(time.monotonic() - self.t0, 2)
        for pid in descendants(self.root):
            rss = rss_bytes(pid)
            if rss is None:
                continue
            if pid not in self.series:
                args = cmdline(pid)
                self.series[pid] = {"label": self.label(pid, args), "pid": pid, "cmd": " ".join(args)[:300],
                                    "samples": []}
            self.series[pid]["samples"].append([now, round(rss / 2**20, 2)])

    def run(self) -> None:
        while not self._halt.is_set():
            self.sample()
            self._halt.wait(self.interval_s)

    def stop(self) -> None:
        self._halt.set()
        self.join(timeout=10)


# --- the stack ----------------------------------------------------------------------------------

class Stack:
    """``shardline up`` in its own session, state and logs in ``workdir``."""

    def __init__(self, model: str, replicas: int, ports: dict[str, int], workdir: Path, extra: list[str]) -> None:
        self.ports, self.workdir = ports, workdir
        self.argv = [sys.executable, "-m", "services.cli", "up", "--model", model, "--replicas", str(replicas),
                     "--port", str(ports["router"]), "--http-port", str(ports["http"]),
                     "--port-base", str(ports["base"]), "--log-dir", str(workdir / "logs"), *extra]
        self.env = child_environ(SHARDLINE_STATE_DIR=str(workdir / "state"))
        self.log = workdir / "up.out"
        self.base_url = f"http://127.0.0.1:{ports['http']}/v1"
        self.proc: subprocess.Popen | None = None

    def start(self, timeout_s: float) -> float:
        for name in ("router", "http"):  # else /health may answer from someone else's stack
            with socket.socket() as sock:
                try:
                    sock.bind(("127.0.0.1", self.ports[name]))
                except OSError:
                    raise RuntimeError(f"port {self.ports[name]} ({name}) is in use: "
                                       f"pick another --port-base") from None
        t0 = time.monotonic()
        with self.log.open("wb") as out:
            self.proc = subprocess.Popen(self.argv, cwd=REPO, env=self.env, stdout=out, stderr=subprocess.STDOUT,
                                         start_new_session=True)
        started = time.monotonic() - t0
        return started + wait_http_health(self.proc, f"http://127.0.0.1:{self.ports['http']}/health",
                                          timeout_s - started, "shardline up", self.tail)

    def drained(self, replicas: int, timeout_s: float = 20.0) -> dict[str, dict[str, Any]]:
        """Each worker's queues and KV blocks once the clients are gone (waits up to ``timeout_s``
        for them to empty): a cancelled stream must not leave a sequence or a block behind."""
        out: dict[str, dict[str, Any]] = {}
        with grpc.insecure_channel(f"127.0.0.1:{self.ports['router']}") as channel:
            groups = router_pb2_grpc.RouterServiceStub(channel).ListReplicaGroups(
                router_pb2.ListReplicaGroupsRequest(), timeout=10).groups
        addresses = [g.address for g in groups if g.status in (common_pb2.REPLICA_GROUP_STATUS_HEALTHY,
                                                               common_pb2.REPLICA_GROUP_STATUS_DEGRADED)]
        for i, address in enumerate(addresses[:replicas]):
            deadline = time.monotonic() + timeout_s
            with grpc.insecure_channel(address) as channel:
                stub = worker_pb2_grpc.WorkerServiceStub(channel)
                while True:
                    try:
                        st = stub.Stats(worker_pb2.StatsRequest(), timeout=5)
                        row = {"running": st.running, "waiting": st.waiting, "blocks_used": st.blocks_used,
                               "kv_bytes_used": st.kv_bytes_used}
                    except grpc.RpcError as exc:
                        row = {"error": f"{exc.code().name}: {exc.details()}"}
                    empty = row.get("running") == 0 and row.get("waiting") == 0 and row.get("blocks_used") == 0
                    if empty or time.monotonic() > deadline:
                        break
                    time.sleep(0.25)
            out[f"worker-{i}"] = {**row, "drained": empty}
        return out

    def model_name(self) -> str:
        models = httpx.get(f"{self.base_url}/models", timeout=10).json()["data"]
        return models[0]["id"]

    def tail(self, n: int = 3000) -> str:
        return self.log.read_text(errors="replace")[-n:] if self.log.exists() else ""

    def stop(self, timeout_s: float = 60) -> int | None:
        if self.proc is None:
            return None
        tree = descendants(self.proc.pid)  # `up` starts each service in a session of its own
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            for pid in reversed(tree):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            return self.proc.wait()


# --- figures ------------------------------------------------------------------------------------

def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    k = (len(ordered) - 1) * q / 100
    lo, hi = int(k), min(int(k) + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def ms(values: list[float]) -> dict[str, float | None]:
    def r(x: float | None) -> float | None:
        return None if x is None else round(x * 1e3, 2)
    return {"p50": r(percentile(values, 50)), "p99": r(percentile(values, 99)),
            "max": r(max(values) if values else None), "count": len(values)}


def rss_growth(series: list[dict[str, Any]], start_s: float, end_s: float) -> tuple[float, list[dict[str, Any]]]:
    """Per process: mean RSS over the first window of the load vs the last (a minute, or a
    quarter of the run when that is shorter than four minutes)."""
    window = min(60.0, (end_s - start_s) / 4)
    rows = []
    for s in series:
        first = [mb for t, mb in s["samples"] if start_s <= t <= start_s + window]
        last = [mb for t, mb in s["samples"] if end_s - window <= t <= end_s]
        if not first or not last:
            rows.append({"label": s["label"], "pid": s["pid"], "first_mb": None, "last_mb": None,
                         "growth_mb": None, "growth_pct": None, "peak_mb": max(mb for _, mb in s["samples"])})
            continue
        a, b = sum(first) / len(first), sum(last) / len(last)
        rows.append({"label": s["label"], "pid": s["pid"], "first_mb": round(a, 1), "last_mb": round(b, 1),
                     "growth_mb": round(b - a, 1), "growth_pct": round((b - a) / a * 100, 1) if a else None,
                     "peak_mb": max(mb for _, mb in s["samples"])})
    return window, rows


def results(args: argparse.Namespace, stack: Stack, model: str, stats: Stats, sampler: ProcessSampler,
            load_window: tuple[float, float], startup_s: float, client_cpu_s: float, exit_code: int | None,
            load_avg: tuple[float, float]) -> dict[str, Any]:
    start_s, end_s = load_window
    elapsed = end_s - start_s
    series = sorted(sampler.series.values(), key=lambda s: (s["label"], s["pid"]))
    window, growth = rss_growth(series, start_s, end_s)
    total = sum(stats.outcomes.values())
    out = {
        "config": {"model": args.model, "served_model": model, "streams": args.streams, "duration_s": args.duration,
                   "malformed_share": args.malformed_share, "cancel_share": args.cancel_share,
                   "replicas": args.replicas, "seed": args.seed, "sample_interval_s": args.sample_interval,
                   "command": " ".join(stack.argv[2:])},
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
                    "load_avg_1m_before": load_avg[0], "load_avg_1m_after": load_avg[1],
                    "psutil": psutil is not None},
        "startup_s": round(startup_s, 1), "load_s": round(elapsed, 1),
        "requests": {"total": total, "by_outcome": dict(stats.outcomes.most_common())},
        "errors_by_class": dict(stats.errors.most_common()), "error_samples": stats.error_samples,
        "malformed": {kind: {"expected": stats.expected[kind], "by_status": dict(c)}
                      for kind, c in sorted(stats.malformed.items())},
        "status_5xx": stats.status_5xx,
        "unexpected_stream_errors": stats.outcomes["stream_error"],
        "inter_token_gap_ms": ms(stats.gaps_s), "ttft_ms": ms(stats.ttft_s),
        "tokens": stats.tokens, "tokens_per_s": round(stats.tokens / elapsed, 1) if elapsed > 0 else None,
        "requests_per_s": round(total / elapsed, 2) if elapsed > 0 else None,
        "client_cpu_s": round(client_cpu_s, 1), "stack_exit_code": exit_code,
        "rss": {"window_s": round(window, 1), "load_start_s": round(start_s, 2), "load_end_s": round(end_s, 2),
                "growth": growth, "processes": series},
        # a slice's tokens/s over its part of the load (the last slice may be short; requests
        # still in flight at the deadline finish after it and count in the slice they end in)
        "over_time": [{"t_s": t, "outcomes": dict(b["outcomes"]),
                       "tokens_per_s": round(b["tokens"] / max(1.0, min(stats.bucket_s, elapsed - t)), 1),
                       "inter_token_gap_ms": ms(b["gaps_s"])} for t, b in sorted(stats.buckets.items())],
    }
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.soak", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny", help="tiny | smollm2 | a model directory (default tiny)")
    parser.add_argument("--streams", type=int, default=64, help="concurrent client loops (default 64)")
    parser.add_argument("--duration", type=float, default=600.0, help="seconds of load (default 600)")
    parser.add_argument("--malformed-share", type=float, default=0.1, help="share of malformed requests (0.1)")
    parser.add_argument("--cancel-share", type=float, default=0.1, help="share of streams cut mid-stream (0.1)")
    parser.add_argument("--replicas", type=int, default=1, help="replica groups (default 1)")
    parser.add_argument("--port-base", type=int, default=None,
                        help="router, HTTP, then the internal services on consecutive ports from here "
                             "(default: free ports)")
    parser.add_argument("--sample-interval", type=float, default=2.0, help="seconds between RSS samples (2)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--startup-timeout", type=float, default=600.0)
    parser.add_argument("--up-arg", action="append", default=[], help="extra flag for `shardline up` (repeatable)")
    parser.add_argument("--out", type=Path, default=RESULTS, help="directory of the results (default bench/results)")
    args = parser.parse_args(argv)
    if not 0 <= args.malformed_share + args.cancel_share <= 1:
        parser.error("--malformed-share + --cancel-share must be within [0, 1]")

    workdir = Path(tempfile.mkdtemp(prefix="bench-soak-"))
    load_before = os.getloadavg()[0]
    stack = Stack(args.model, args.replicas, ports_for(args.port_base, args.replicas), workdir, args.up_arg)
    print(f"starting: {' '.join(stack.argv[2:])} (logs in {workdir})", flush=True)
    sampler, exit_code = None, None
    try:
        startup_s = stack.start(args.startup_timeout)
        model = stack.model_name()
        print(f"stack healthy after {startup_s:.1f} s, model {model}; {args.streams} streams for "
              f"{args.duration:g} s", flush=True)
        sampler = ProcessSampler(stack.proc.pid, stack.ports, args.sample_interval)
        sampler.start()
        load = Load(stack.base_url, model, streams=args.streams, malformed_share=args.malformed_share,
                    cancel_share=args.cancel_share, seed=args.seed)
        cpu0 = sum(os.times()[:2])
        start_s = time.monotonic() - sampler.t0
        stats = asyncio.run(load.run(args.duration))
        end_s = time.monotonic() - sampler.t0
        client_cpu = sum(os.times()[:2]) - cpu0
        alive = stack.proc.poll() is None
        after = stack.drained(args.replicas) if alive else {}
    finally:
        try:
            if sampler is not None:
                sampler.stop()
        finally:
            exit_code = stack.stop()
    if not alive:
        print(f"the stack died during the load:\n{stack.tail()}", file=sys.stderr)
    result = results(args, stack, model, stats, sampler, (start_s, end_s), startup_s, client_cpu,
                     exit_code, (load_before, os.getloadavg()[0]))
    result["stack_alive_at_end"] = alive
    result["workers_after_load"] = after
    result["verdict"] = verdict(result)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "soak.json").write_text(json.dumps(result, indent=1) + "\n")
    plotted = plot_rss(result, args.out / "soak-rss.png")
    (args.out / "soak.md").write_text(markdown(result, plotted))
    print(markdown(result, plotted))
    return 0 if result["verdict"]["pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
