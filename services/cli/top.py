"""``shardline top``: a live view of the fleet behind a router, refreshed in place.

One line per replica group the router knows: plan, status, KV use, requests running and waiting
(the router's ``ListReplicaGroups``), TTFT and time per output token p50/p99 and generated tokens
per second (vLLM's series on the router's ``/metrics``, labelled ``replica_group``), and each
fleet's revision and current rollout (the registry). Latencies and tokens/s cover the last
interval; ``--once`` prints one frame (latencies since the router started, tokens/s over one
second) and exits, for scripts.

    shardline top --router 127.0.0.1:50051 --metrics-url http://127.0.0.1:8000/metrics [--once]
"""

from __future__ import annotations

import argparse
import collections
import math
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from services.common.config import DEFAULT_PORTS, resolve
from services.common.proto import common_pb2, router_pb2, router_pb2_grpc
from services.common.proto_convert import DTYPE_FROM_PB
from services.common.registry import FleetNotFound, ShardRegistry
from services.common.registry.engine import registry_url
from services.common.transport_security import open_channel

CLEAR = "\x1b[H\x1b[2J"  # cursor home, clear screen: the next frame replaces this one
LATENCIES = {"ttft": "vllm:time_to_first_token_seconds", "tpot": "vllm:inter_token_latency_seconds"}
TOKENS = "vllm:generation_tokens_total"


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("top", help="a live view of the fleet behind a router")
    parser.add_argument("--router", default=f"127.0.0.1:{DEFAULT_PORTS['router']}", help="router gRPC address")
    parser.add_argument("--metrics-url", default="http://127.0.0.1:8000/metrics",
                        help="the router's /metrics (its HTTP port; default http://127.0.0.1:8000/metrics)")
    parser.add_argument("--registry-url", default=None,
                        help="shard registry, for the fleets' revisions and rollouts (env SHARDLINE_REGISTRY_URL; "
                             "default: the embedded SQLite file)")
    parser.add_argument("--interval", type=float, default=2.0, help="seconds between frames (default 2)")
    parser.add_argument("--window", type=float, default=10.0,
                        help="seconds the latencies and tokens/s cover (default 10: a group's requests are counted "
                             "as they end)")
    parser.add_argument("--once", action="store_true", help="print one frame and exit")
    parser.set_defaults(func=run)


@dataclass
class Scrape:
    """Per group: cumulative bucket counts of each latency histogram, and tokens generated."""

    at: float
    buckets: dict[tuple[str, str], dict[float, float]] = field(default_factory=dict)  # (group, kind) -> le -> n
    tokens: dict[str, float] = field(default_factory=dict)


def scrape(url: str, token: str | None = None) -> Scrape:
    request = urllib.request.Request(url, headers={"authorization": f"Bearer {token}"} if token else {})
    with urllib.request.urlopen(request, timeout=5) as response:
        text = response.read().decode()
    out = Scrape(time.monotonic())
    names = {f"{metric}_bucket": kind for kind, metric in LATENCIES.items()}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            group = sample.labels.get("replica_group")
            if not group:
                continue
            if sample.name in names:
                le = float(sample.labels["le"])
                counts = out.buckets.setdefault((group, names[sample.name]), {})
                counts[le] = counts.get(le, 0.0) + sample.value
            elif sample.name == TOKENS:
                out.tokens[group] = out.tokens.get(group, 0.0) + sample.value
    return out


def quantile(q: float, buckets: dict[float, float]) -> float | None:
    """``histogram_quantile`` of cumulative bucket counts (linear within a bucket); None: empty."""
    bounds = sorted(buckets)
    if not bounds or buckets[bounds[-1]] <= 0:
        return None
    rank = q * buckets[bounds[-1]]
    lower, below = 0.0, 0.0
    for le in bounds:
        count = buckets[le]
        if count >= rank:
            if math.isinf(le):
                return lower
            return lower + (le - lower) * ((rank - below) / (count - below) if count > below else 1.0)
        lower, below = le, count
    return lower


def _delta(now: dict[float, float], before: dict[float, float] | None) -> dict[float, float]:
    return {le: n - (before or {}).get(le, 0.0) for le, n in now.items()}


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.0f}"


def _status(value: int) -> str:
    """``REPLICA_GROUP_STATUS_HEALTHY`` -> ``healthy``."""
    return common_pb2.ReplicaGroupStatus.Name(value).removeprefix("REPLICA_GROUP_STATUS_").lower()


def frame(groups: list[Any], now: Scrape, before: Scrape, fleets: list[str], *, since_start: bool = False) -> str:
    """One frame; latencies over ``before`` .. ``now`` (``since_start``: all of ``now``'s),
    tokens/s over the same span."""
    window = "since the router started" if since_start else f"over the last {now.at - before.at:.0f} s"
    lines = [f"shardline top  {time.strftime('%H:%M:%S')}  {len(groups)} replica group(s), latencies {window}"]
    lines += fleets
    lines.append(f"{'GROUP':<26} {'PLAN':<20} {'STATUS':<12} {'KV %':>5} {'RUN':>4} {'WAIT':>4} "
                 f"{'TTFT ms p50/p99':>16} {'TPOT ms p50/p99':>16} {'TOK/S':>7}")
    for g in sorted(groups, key=lambda g: g.replica_group_id):
        gid = g.replica_group_id
        plan = f"TP{g.layout.tp_degree} x PP{g.layout.pp_degree} {DTYPE_FROM_PB.get(g.layout.dtype, '')}"
        kv = f"{100.0 * g.kv_bytes_used / g.kv_bytes_capacity:.1f}" if g.kv_bytes_capacity else "-"
        cells = []
        for kind in LATENCIES:
            counts = _delta(now.buckets.get((gid, kind), {}), None if since_start else before.buckets.get((gid, kind)))
            cells.append(f"{_ms(quantile(0.5, counts))}/{_ms(quantile(0.99, counts))}")
        rate = "-"
        if gid in now.tokens and now.at > before.at:
            rate = f"{(now.tokens[gid] - before.tokens.get(gid, 0.0)) / (now.at - before.at):.1f}"
        status = _status(g.status)
        lines.append(f"{gid:<26} {plan:<20} {status:<12} {kv:>5} {g.running:>4} {g.waiting:>4} "
                     f"{cells[0]:>16} {cells[1]:>16} {rate:>7}")
    return "\n".join(lines)


def fleet_lines(url: str, groups: list[Any]) -> list[str]:
    """Each fleet of the groups' models (a fleet serves under its name): its revision and its
    latest rollout; nothing when the registry cannot say."""
    out = []
    try:
        with ShardRegistry(url) as registry:
            for model in sorted({g.model for g in groups}):
                try:
                    revision = registry.fleet_revision(model)
                except FleetNotFound:
                    continue
                rollout = registry.latest_rollout(model)
                out.append(f"fleet {model}: revision {revision.revision}"
                           + (f", rollout {rollout.from_revision} -> {rollout.to_revision} {rollout.status}"
                              if rollout is not None else ""))
    except Exception:  # noqa: BLE001 - no registry there (a router without fleets): the groups alone
        return []
    return out


def groups_of(router: str, token: str | None) -> list[Any]:
    metadata = [("authorization", f"Bearer {token}")] if token else None
    with open_channel(router) as channel:
        return list(router_pb2_grpc.RouterServiceStub(channel).ListReplicaGroups(
            router_pb2.ListReplicaGroupsRequest(), timeout=5, metadata=metadata).groups)


def run(args: argparse.Namespace) -> int:
    token = resolve("api_key", None, "") or None
    url = registry_url(args.registry_url)
    try:
        before = scrape(args.metrics_url, token)
        if args.once:
            time.sleep(1.0)  # tokens/s over one second; the latencies are the router's whole history
            groups = groups_of(args.router, token)
            print(frame(groups, scrape(args.metrics_url, token), before, fleet_lines(url, groups),
                        since_start=True))
            return 0
        history = collections.deque([before])  # the scrapes of the last window, oldest first
        while True:
            time.sleep(args.interval)
            groups = groups_of(args.router, token)
            now = scrape(args.metrics_url, token)
            while len(history) > 1 and now.at - history[1].at >= args.window:
                history.popleft()
            sys.stdout.write(CLEAR + frame(groups, now, history[0], fleet_lines(url, groups)) + "\n")
            sys.stdout.flush()
            history.append(now)
    except KeyboardInterrupt:
        return 0
    except Exception as exc:  # noqa: BLE001 - a router that does not answer: say so, exit 1
        print(f"shardline top: {exc}", file=sys.stderr)
        return 1

