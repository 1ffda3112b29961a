"""``shardline apply -f fleet.yaml``: declare a fleet's desired state (a new revision in the registry).

The fleet controller (``shardline serve fleet``) picks the revision up on its next reconcile:
a new plan (layout, dtype, checkpoint) starts a rollout, a new replica count or autoscaling
block only changes how many groups it keeps. Applying the spec the newest revision already
holds changes nothing.

    shardline apply -f fleet.yaml --registry-url postgresql+psycopg://...
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from services.common.registry import FleetNotFound, ShardRegistry
from services.fleet.spec import FleetSpec, InvalidFleetSpec


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("apply", help="declare a fleet (shard-plan.yaml shape): a new revision")
    parser.add_argument("-f", "--file", type=Path, required=True, help="the fleet spec (YAML)")
    parser.add_argument("--registry-url", default=None,
                        help="shard registry URL (env SHARDLINE_REGISTRY_URL; default: the embedded SQLite file)")
    parser.set_defaults(func=run)


def apply_spec(spec: FleetSpec, registry: ShardRegistry) -> tuple[int, bool, str]:
    """(revision, created, what it changes) for ``spec`` applied to ``registry``."""
    try:
        previous = FleetSpec.from_json(registry.fleet_revision(spec.name).spec)
    except FleetNotFound:
        previous = None
    revision, created = registry.apply_fleet(spec.name, spec.to_json())
    if not created:
        change = "unchanged"
    elif previous is None:
        change = f"new fleet: {spec.replicas} group(s) of {spec.group.describe()}"
    elif previous.plan_key() != spec.plan_key():
        change = f"a rollout from {previous.group.describe()} to {spec.group.describe()}"
    else:
        change = "the same plan: no rollout"
    return revision.revision, created, change


def run(args: argparse.Namespace) -> int:
    try:
        spec = FleetSpec.load(args.file)
    except InvalidFleetSpec as exc:
        print(f"shardline apply: {exc}", file=sys.stderr)
        return 2
    with ShardRegistry(args.registry_url, migrate_schema=True) as registry:
        revision, created, change = apply_spec(spec, registry)
    print(f"fleet {spec.name}: revision {revision} ({'applied' if created else 'already the newest'}; {change})")
    return 0
