"""``shardline fleet status --fleet NAME``: every group of a fleet, as the registry and its workers say.

One line per replica group: id, plan, the fleet revision it was built from, status (and why),
KV-cache utilization (its last heartbeat) and the requests it holds (its worker's Stats; ``-``
when the worker does not answer). Dead groups are listed with the reason, newest ten.

    shardline fleet status --fleet smollm2 [--json]
    shardline fleet render -f fleet.yaml --out k8s/   # the fleet's Kubernetes objects (fleet_render)
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from services.cli import fleet_render
from services.common.numerics import DEFAULT_NUMERICS
from services.common.proto import worker_pb2, worker_pb2_grpc
from services.common.registry import IN_ROTATION, FleetNotFound, ReplicaGroup, ShardRegistry
from services.common.transport_security import open_channel
from services.fleet.load_signal import registry_utilization
from services.fleet.spec import FleetSpec

DEAD_SHOWN = 10


def register(subparsers: argparse._SubParsersAction) -> None:
    fleet = subparsers.add_parser("fleet", help="a fleet: status of its groups, or its Kubernetes objects")
    actions = fleet.add_subparsers(dest="action", metavar="ACTION", required=True)
    parser = actions.add_parser("status", help="every group of a fleet: plan, revision, status, KV, requests")
    fleet_render.add_render_command(actions)
    parser.add_argument("--fleet", required=True, help="the fleet's name (its replica_group.name)")
    parser.add_argument("--registry-url", default=None,
                        help="shard registry URL (env SHARDLINE_REGISTRY_URL; default: the embedded SQLite file)")
    parser.add_argument("--json", action="store_true", help="print the status as JSON")
    parser.set_defaults(func=run)


def _requests(endpoint: str | None) -> int | None:
    if not endpoint:
        return None
    try:
        with open_channel(endpoint) as channel:
            stats = worker_pb2_grpc.WorkerServiceStub(channel).Stats(worker_pb2.StatsRequest(), timeout=2)
        return stats.running + stats.waiting
    except Exception:  # noqa: BLE001 - a worker that does not answer shows "-"
        return None


def group_status(registry: ShardRegistry, g: ReplicaGroup) -> dict[str, Any]:
    ratio = registry_utilization(registry, [g]).get(g.name or "")
    util = None if ratio is None else 100.0 * ratio
    numerics = f" {g.numerics}" if g.numerics != DEFAULT_NUMERICS else ""
    return {"id": g.name or str(g.replica_group_id),
            "plan": f"TP{g.tp_degree} x PP{g.pp_degree} {g.project_dtype}{numerics}",
            "revision": g.fleet_revision, "status": g.status, "reason": g.status_reason or "",
            "kv_utilization_pct": None if util is None else round(util, 1), "endpoint": g.endpoint or "",
            "requests": _requests(g.endpoint) if g.status != "dead" else None, "checkpoint": g.manifest_uri or ""}


def fleet_status(registry: ShardRegistry, fleet: str) -> dict[str, Any]:
    revision = registry.fleet_revision(fleet)
    spec = FleetSpec.from_json(revision.spec)
    groups = registry.fleet_groups(fleet, include_dead=True)
    live = [g for g in groups if g.status != "dead"]
    dead = [g for g in groups if g.status == "dead"][-DEAD_SHOWN:]
    rollout = registry.latest_rollout(fleet)
    scaling = spec.autoscaling
    return {"fleet": fleet, "revision": revision.revision, "plan": spec.group.describe(),
            "replicas": (spec.replicas if scaling is None
                         else {"min": scaling.min_replicas, "max": scaling.max_replicas}),
            "in_rotation": sum(1 for g in live if g.status in IN_ROTATION),
            "rollout": None if rollout is None else {"from_revision": rollout.from_revision,
                                                     "to_revision": rollout.to_revision, "status": rollout.status,
                                                     "reason": rollout.reason},
            "groups": [group_status(registry, g) for g in live + dead]}


def run(args: argparse.Namespace) -> int:
    with ShardRegistry(args.registry_url, migrate_schema=True) as registry:
        try:
            status = fleet_status(registry, args.fleet)
        except FleetNotFound:
            print(f"shardline fleet: no fleet {args.fleet} (apply one with `shardline apply -f FILE`)", file=sys.stderr)
            return 1
    if args.json:
        print(json.dumps(status, indent=2))
        return 0
    rollout = status["rollout"]
    print(f"fleet {status['fleet']}: revision {status['revision']}, {status['plan']}, replicas {status['replicas']}, "
          f"{status['in_rotation']} in rotation"
          + (f"; rollout {rollout['from_revision']} -> {rollout['to_revision']} {rollout['status']}"
             if rollout else ""))
    print(f"  {'GROUP':<24} {'PLAN':<22} {'REV':>3}  {'STATUS':<12} {'KV %':>6} {'REQS':>5}  REASON")
    for g in status["groups"]:
        kv = "-" if g["kv_utilization_pct"] is None else f"{g['kv_utilization_pct']:.1f}"
        reqs = "-" if g["requests"] is None else str(g["requests"])
        print(f"  {g['id']:<24} {g['plan']:<22} {g['revision'] or '-':>3}  {g['status']:<12} {kv:>6} {reqs:>5}  "
              f"{g['reason']}")
    return 0
