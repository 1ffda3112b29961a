"""``shardline rollout status|abort --fleet NAME``: the fleet's latest rollout, or end it.

``status`` prints the rollout (revisions, state, why) and its events (surges, gate figures,
drains). ``abort`` asks the controller to return to the revision the rollout came from: it
re-applies that spec, which is rolled out the same way (surge, gate, drain), so nothing is lost.

    shardline rollout status --fleet smollm2
    shardline rollout abort --fleet smollm2
"""

from __future__ import annotations

import argparse
import json
import sys

from services.common.registry import ShardRegistry


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("rollout", help="a fleet's rollout: status, abort")
    parser.add_argument("action", choices=("status", "abort"))
    parser.add_argument("--fleet", required=True, help="the fleet's name (its replica_group.name)")
    parser.add_argument("--registry-url", default=None,
                        help="shard registry URL (env SHARDLINE_REGISTRY_URL; default: the embedded SQLite file)")
    parser.add_argument("--json", action="store_true", help="print the rollout as JSON")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    with ShardRegistry(args.registry_url, migrate_schema=True) as registry:
        rollout = registry.latest_rollout(args.fleet)
        if rollout is None:
            print(f"fleet {args.fleet}: no rollout", file=sys.stderr)
            return 1
        if args.action == "abort":
            if rollout.status != "running":
                print(f"fleet {args.fleet}: the latest rollout is {rollout.status}, nothing to abort", file=sys.stderr)
                return 1
            rollout = registry.update_rollout(rollout.rollout_id, status="aborting", reason="abort asked",
                                              only_if="running") or registry.latest_rollout(args.fleet)
    assert rollout is not None
    events = json.loads(rollout.events)
    if args.json:
        print(json.dumps({"rollout_id": str(rollout.rollout_id), "fleet": rollout.fleet_name,
                          "from_revision": rollout.from_revision, "to_revision": rollout.to_revision,
                          "status": rollout.status, "reason": rollout.reason, "events": events}, indent=2))
        return 0
    print(f"fleet {rollout.fleet_name}: rollout revision {rollout.from_revision} -> {rollout.to_revision}: "
          f"{rollout.status}{f' ({rollout.reason})' if rollout.reason else ''}")
    for e in events:
        detail = " ".join(f"{k}={v}" for k, v in e.items() if k not in ("t", "event"))
        print(f"  {e['event']:<18} {detail}")
    return 0
