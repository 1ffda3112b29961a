"""The replica groups of ``shardline up``: a fleet applied and reconciled in ``up``'s own process.

``up --replicas N --tp T --pp P --dtype D`` is a one-plan fleet of N groups (``up -f FILE``
applies a fleet spec instead); ``--dtype D0,D1,...`` gives each group its own dtype, one fleet
per dtype (a fleet has one plan). Each fleet is named after the model directory (a DNS label,
with the dtype's short name when there are several) and applied to the stack's registry as a new
revision, so a second ``up`` on the same registry and flags applies nothing new.

A fleet controller per fleet (``services.fleet.controller``) starts the groups through the local
provisioner: each group is a ``shardline serve worker`` process group, a child of ``up``. So a
dead worker process is a failed replica group, not a stopped stack: the router continues its
requests on the other groups, the controller marks it ``dead`` in the registry with the exit code
and starts a replacement with the same plan (a new group id), and the router discovers the new
group in the registry. ``shardline apply -f FILE`` against the same registry changes the running
fleet (a rollout), as it does for ``shardline serve fleet``.
"""

from __future__ import annotations

import argparse
import re
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

from services.common.errors import InvalidArgument
from services.common.fork_server import ForkServer
from services.common.registry import IN_ROTATION, ShardRegistry, to_registry_dtype
from services.common.supervisor import StackError, Supervisor
from services.fleet.controller import FleetController
from services.fleet.leader import DEFAULT_TTL_S
from services.fleet.load_signal import RouterUtilization
from services.fleet.local import LocalProvisioner
from services.fleet.server import Reconcilers, controller_signals, worker_shared_flags
from services.fleet.spec import FleetSpec, GroupPlan, InvalidFleetSpec


def fleet_name(model_dir: Path, suffix: str = "") -> str:
    """A DNS label from the model directory's name (``smollm2-135m-instruct``), plus ``-suffix``."""
    base = re.sub(r"[^a-z0-9-]+", "-", model_dir.name.lower()).strip("-") or "model"
    tail = f"-{suffix}" if suffix else ""
    return base[:40 - len(tail)].rstrip("-") + tail


def fleets_from_flags(args: argparse.Namespace, model_dir: Path, dtypes: list[str | None]) -> list[FleetSpec]:
    """One fleet per distinct dtype, in the order the groups name them."""
    counts: dict[str, int] = {}
    for dtype in dtypes:
        counts[dtype or "float32"] = counts.get(dtype or "float32", 0) + 1
    several = len(counts) > 1
    specs = []
    for dtype, replicas in counts.items():
        plan = GroupPlan(tp_degree=args.tp, pp_degree=args.pp, dtype=dtype, kv_cache_cap_gb=args.kv_cache_gb,
                         model_dir=str(model_dir), prefix_caching=args.prefix_caching)
        name = fleet_name(model_dir, to_registry_dtype(dtype) if several else "")
        specs.append(FleetSpec(name, plan, replicas, args.served_model_name))
    return specs


def load_fleet_file(path: Path) -> FleetSpec:
    try:
        return FleetSpec.load(path)
    except InvalidFleetSpec as exc:
        raise InvalidArgument(f"-f {path}: {exc}") from None


class UpFleets:
    """Apply the stack's fleets, reconcile them on threads, and report their groups as they serve."""

    def __init__(self, specs: list[FleetSpec], registry_url: str, supervisor: Supervisor, log_dir: Path, *,
                 telemetry: str, redis_url: str | None, routers: list[str], api_key: str | None,
                 say: Callable[[str], None], fork_server: ForkServer | None = None) -> None:
        self.specs = specs
        self.registry = ShardRegistry(registry_url)
        for spec in specs:
            revision, created = self.registry.apply_fleet(spec.name, spec.to_json())
            say(f"  fleet {spec.name}: revision {revision.revision} ({'applied' if created else 'unchanged'}), "
                f"{spec.replicas} group(s) of {spec.group.describe()}")
        shared = worker_shared_flags(registry_url, redis_url or "", telemetry, [])
        utilization = RouterUtilization(routers, api_key=api_key)
        signals = controller_signals(redis_url, telemetry)
        self.provisioners = {spec.name: LocalProvisioner(supervisor, shared, log_dir, fork_server=fork_server)
                             for spec in specs}

        def make(fleet: str, fenced: ShardRegistry) -> FleetController:
            return FleetController(fenced, self.provisioners[fleet], fleet, registry_url=registry_url,
                                   utilization=utilization, **signals, say=lambda line: say(f"shardline up: {line}"))

        # the stack's one controller per fleet takes the fleet's lease at once: a previous stack on
        # this registry released it, or was a process of this host that is gone
        self.reconcilers = Reconcilers(self.registry, self.provisioners, make, interval_s=1.0,
                                       lease_ttl_s=DEFAULT_TTL_S)
        self._reported: set[str] = set()

    def start(self) -> None:
        self.started = datetime.now(UTC)  # groups made from here on are this stack's
        self.reconcilers.start()

    def wait_in_rotation(self, timeout_s: float, stop: Callable[[], bool],
                         say: Callable[[str], None]) -> None:
        """Until every fleet has its groups in rotation; each group is reported once it is."""
        start = time.monotonic()
        wanted = {spec.name: spec.bounded(spec.replicas) for spec in self.specs}
        while True:
            ready = True
            for fleet, count in wanted.items():
                rows = self.registry.fleet_groups(fleet, include_dead=True)
                failed = [g for g in rows if g.status == "dead" and g.created_at >= self.started]
                if failed:  # while starting, a failure is the stack's: say why at once
                    raise StackError(f"replica group {failed[0].name} failed while starting: "
                                     f"{failed[0].status_reason}")
                groups = [g for g in rows if g.status in IN_ROTATION]
                for g in groups:
                    if g.name not in self._reported:
                        self._reported.add(g.name or "")
                        say(f"  {g.name:<10} {g.endpoint:<16} SERVING  (+{time.monotonic() - start:.1f} s)")
                ready = ready and len(groups) >= count
            if ready:
                return
            if stop():
                raise StackError("stopped while starting")
            if time.monotonic() - start > timeout_s:
                raise StackError(f"the replica groups were not all in rotation within {timeout_s:g} s "
                                 f"(logs in the log directory)")
            time.sleep(0.2)

    def close(self) -> None:
        self.reconcilers.close()
        for provisioner in self.provisioners.values():
            provisioner.close()
        self.registry.close()
