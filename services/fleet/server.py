"""FleetService: the fleet controller as a service of its own (``shardline serve fleet``).

It serves no RPC of its own: the desired state is the registry's (``shardline apply`` writes a
revision, ``shardline fleet status`` and ``rollout status|abort`` read and write it there), and
the gRPC port answers health checks only. The controller runs here rather than in the planner
because it owns processes: with the local provisioner, the fleet's worker process groups are its
children (they stop with it); with the Kubernetes one, it owns their LeaderWorkerSets.

Flags beyond the fleet's own (``--registry-url``, ``--redis-url``, ``--telemetry``) are handed
to every worker it starts, so the groups register where the routers discover them. The
controller itself reads the ranks' health from that Redis and pages through that telemetry.
"""

from __future__ import annotations

import argparse
import logging
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from services.common.config import resolve
from services.common.grpc_server import GrpcServer, serve_service
from services.common.health import make_health_store
from services.common.logging import say_line, stacks_on_signal
from services.common.registry import Fenced, ShardRegistry, registry_url
from services.common.supervisor import Supervisor
from services.fleet import metrics
from services.fleet.controller import HEARTBEAT_TIMEOUT_S, STARTUP_TIMEOUT_S, FleetController, tidy_own
from services.fleet.kubernetes import KubernetesSettings
from services.fleet.kubernetes_provisioner import KubernetesApi, KubernetesProvisioner
from services.fleet.leader import DEFAULT_TTL_S, LEASE, LeaderElection
from services.fleet.load_signal import RouterUtilization
from services.fleet.local import LocalProvisioner
from services.fleet.paging import telemetry_pager
from services.fleet.provisioner import Provisioner
from services.fleet.spec import FleetSpec, InvalidFleetSpec
from services.telemetry.observability import add_metrics_arguments, setup_observability

SERVICE = "fleet"
log = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--fleet", action="append", default=None, metavar="NAME",
                        help="fleet to reconcile (repeatable; env SHARDLINE_FLEET, comma-separated); it must have "
                             "been applied with `shardline apply`")
    parser.add_argument("--spec", type=Path, default=None, metavar="FILE",
                        help="apply this fleet spec at start (as `shardline apply -f FILE`) and reconcile its fleet")
    parser.add_argument("--provisioner", choices=("local", "kubernetes"), default="local",
                        help="local: each group is a `shardline serve worker` process group, children of this one "
                             "(default); kubernetes: each group is a LeaderWorkerSet, applied to the API server (the "
                             "pod's service account in the cluster, else the kubeconfig)")
    parser.add_argument("--namespace", default="shardline", help="kubernetes: the fleet's namespace")
    parser.add_argument("--image", default="shardline:latest", help="kubernetes: the image of the rank pods")
    parser.add_argument("--registry-url", default=None, help="shard registry URL (env SHARDLINE_REGISTRY_URL; "
                                                             "default: the embedded SQLite file)")
    parser.add_argument("--redis-url", default=None, help="health store the workers share (env SHARDLINE_REDIS_URL)")
    parser.add_argument("--telemetry", default=None, metavar="ADDRESS",
                        help="telemetry service the workers ship to (env SHARDLINE_TELEMETRY_ADDR)")
    parser.add_argument("--log-dir", type=Path, default=Path(".run/logs"),
                        help="the workers' logs (default .run/logs)")
    parser.add_argument("--interval", type=float, default=1.0, help="seconds between reconciles (default 1)")
    parser.add_argument("--heartbeat-timeout", type=float, default=HEARTBEAT_TIMEOUT_S,
                        help=f"a group in rotation whose heartbeats stop this long is dead (default "
                             f"{HEARTBEAT_TIMEOUT_S:g} s)")
    parser.add_argument("--startup-timeout", type=float, default=STARTUP_TIMEOUT_S,
                        help=f"a group not ready this long after its start is dead (default {STARTUP_TIMEOUT_S:g} s)")
    parser.add_argument("--router", action="append", default=[], metavar="ADDRESS",
                        help="a router whose committed KV the autoscaler reads (repeatable; default: the workers' "
                             "heartbeats in the registry)")
    parser.add_argument("--router-api-key", default=None,
                        help="the routers' API key, if they want one (env SHARDLINE_API_KEY)")
    parser.add_argument("--keep-groups", action="store_true",
                        help="local: the groups outlive this controller (a restarted one, or a standby that takes "
                             "over, adopts them through their records in --log-dir/groups/); default: they stop "
                             "with it")
    parser.add_argument("--lease-ttl", type=float, default=DEFAULT_TTL_S, metavar="SECONDS",
                        help=f"several controllers may run: the one holding a fleet's lease in the registry acts, "
                             f"the others take over once it has not renewed it for this long (default "
                             f"{DEFAULT_TTL_S:g} s; a killed controller's lease on the same host is taken at once)")
    parser.add_argument("--worker-flag", action="append", default=[], metavar="FLAG",
                        help="one more flag for every worker, e.g. --worker-flag=--collective-timeout=5")
    add_metrics_arguments(parser)


def worker_shared_flags(registry: str, redis: str, telemetry: str, extra: list[str]) -> list[str]:
    flags = ["--registry-url", registry]
    if redis:
        flags += ["--redis-url", redis]
    if telemetry:
        flags += ["--telemetry", telemetry]
    return flags + list(extra)


def controller_signals(redis: str | None, telemetry: str | None) -> dict[str, Any]:
    """The controller's ``health`` (the ranks' health in Redis) and ``page`` (alerts through
    telemetry), each None without its service."""
    return {"health": make_health_store(redis) if redis else None,
            "page": telemetry_pager(telemetry) if telemetry else None}


class Reconcilers:
    """One controller per fleet, each on its own thread while this process leads that fleet (its
    lease, ``leader.py``), and their metrics. Each new term gets a fresh controller on a registry
    fenced by that term; a standby only watches the lease."""

    def __init__(self, registry: ShardRegistry, provisioners: dict[str, Provisioner],
                 make: Callable[[str, ShardRegistry], FleetController], interval_s: float, lease_ttl_s: float) -> None:
        fleets = list(provisioners)
        self.registry = registry
        self.provisioners = provisioners
        self.make = make
        self.interval_s = interval_s
        self.elections = {f: LeaderElection(registry, name=f"{LEASE}/{f}", ttl_s=lease_ttl_s) for f in fleets}
        self.controllers: dict[str, FleetController] = {}
        self.ready: dict[str, bool] = dict.fromkeys(fleets, False)  # the fleet's last reconcile (or watch) worked
        self.on_ready: Callable[[bool], None] = lambda _ready: None  # every fleet's worked, or not
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._run, args=(f,), name=f"fleet-{f}", daemon=True) for f in fleets]

    def _run(self, fleet: str) -> None:
        election = self.elections[fleet]
        metrics.leading(fleet, None)
        while not self.stop.is_set():
            leading = election.step()
            controller = self.controllers.get(fleet)
            if controller is not None and (not leading or controller.registry.fence != (election.name, election.term)):
                self._step_down(fleet)  # deposed, or a new term: the old controller's registry is fenced out
                controller = None
            if leading and controller is None:
                controller = self.controllers[fleet] = self.make(fleet, self.registry.fenced(election.name,
                                                                                             election.term))
                metrics.leading(fleet, election.term)
            self._set_ready(fleet, self._reconcile(fleet, controller))
            self.stop.wait(self.interval_s)

    def _reconcile(self, fleet: str, controller: FleetController | None) -> bool:
        """One pass; whether it worked (a registry or provisioner outage: not ready, tried again)."""
        try:
            if controller is None:  # a standby: it stops only its own processes of groups the leader ended
                for name in tidy_own(self.registry, self.provisioners[fleet], fleet):
                    log.info("fleet %s: stopped %s, dead in the registry (standby)", fleet, name)
                return True
            controller.tick()
            metrics.publish(fleet, controller.state.desired, controller.registry.fleet_groups(fleet),
                            controller.state.utilization_pct)
            return True
        except Fenced as exc:  # paused past the TTL: the next step finds the lease gone
            log.warning("fleet %s: %s", fleet, exc)
            return True
        except Exception as exc:  # noqa: BLE001 - an outage must not end the loop: retried next interval
            log.warning("fleet %s: reconcile failed, retrying in %g s: %s", fleet, self.interval_s, exc,
                        exc_info=log.isEnabledFor(10))
            return False

    def _set_ready(self, fleet: str, ready: bool) -> None:
        was = all(self.ready.values())
        self.ready[fleet] = ready
        now = all(self.ready.values())
        if now != was:
            self.on_ready(now)

    def _step_down(self, fleet: str) -> None:
        controller = self.controllers.pop(fleet)
        controller.registry.close()
        metrics.leading(fleet, None)

    def start(self) -> None:
        for thread in self.threads:
            thread.start()

    def close(self) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(timeout=10)
        for fleet, controller in list(self.controllers.items()):
            controller.jobs.wait_all(5.0)
            self._step_down(fleet)
        for election in self.elections.values():
            election.release()


def provisioner_for(args: argparse.Namespace, supervisor: Supervisor, shared: list[str], url: str,
                    fleet: str) -> Provisioner:
    if args.provisioner == "local":
        return LocalProvisioner(supervisor, shared, args.log_dir, keep=args.keep_groups, fleet=fleet)
    settings = KubernetesSettings(image=args.image, namespace=args.namespace, registry_url=url,
                                  redis_url=resolve("redis_url", args.redis_url, "") or None)
    # its groups outlive a restart of the controller's pod: closing it deletes nothing, and the
    # restarted controller finds them by the fleet's label
    return KubernetesProvisioner(settings, KubernetesApi(args.namespace), fleet=fleet, delete_on_close=False)


def serve(args: argparse.Namespace) -> int:
    given = args.fleet or [resolve("fleet", None, "")]
    fleets = [f.strip() for value in given for f in value.split(",") if f.strip()]
    url = registry_url(resolve("registry_url", args.registry_url, "") or None)
    registry = ShardRegistry(url, migrate_schema=True)
    if args.spec is not None:
        try:
            spec = FleetSpec.load(args.spec)
        except InvalidFleetSpec as exc:
            print(f"shardline serve fleet: {exc}", file=sys.stderr)
            return 2
        revision, created = registry.apply_fleet(spec.name, spec.to_json())
        print(f"fleet {spec.name}: revision {revision.revision} ({'applied' if created else 'already the newest'})",
              flush=True)
        fleets = [*fleets, spec.name] if spec.name not in fleets else fleets
    if not fleets:
        print("shardline serve fleet: --fleet NAME, --spec FILE (or SHARDLINE_FLEET) is required", file=sys.stderr)
        return 2
    missing = [f for f in fleets if f not in registry.list_fleets()]
    if missing:
        print(f"shardline serve fleet: no fleet {', '.join(missing)} in the registry (`shardline apply -f FILE` "
              f"first)", file=sys.stderr)
        return 2
    redis, telemetry = resolve("redis_url", args.redis_url, ""), resolve("telemetry_addr", args.telemetry, "")
    shared = worker_shared_flags(url, redis, telemetry, args.worker_flag)
    supervisor = Supervisor()
    provisioners = [provisioner_for(args, supervisor, shared, url, fleet) for fleet in fleets]
    provisioner_of = dict(zip(fleets, provisioners, strict=True))
    utilization = (RouterUtilization(args.router, api_key=resolve("api_key", args.router_api_key, "") or None)
                   if args.router else None)
    signals = controller_signals(redis, telemetry)

    def make(fleet: str, fenced: ShardRegistry) -> FleetController:
        return FleetController(fenced, provisioner_of[fleet], fleet, registry_url=url,
                               heartbeat_timeout_s=args.heartbeat_timeout, startup_timeout_s=args.startup_timeout,
                               utilization=utilization, **signals,
                               say=lambda line: say_line(f"{time.time():.3f} {line}"))

    reconcilers = Reconcilers(registry, provisioner_of, make, args.interval, args.lease_ttl)

    def on_started(server: GrpcServer) -> None:
        setup_observability(args, SERVICE)
        stacks_on_signal()  # a controller that stopped acting can be asked where it is
        reconcilers.on_ready = server.set_serving  # SERVING once every fleet reconciles, NOT_SERVING while one cannot
        reconcilers.start()

    try:
        return serve_service(args, service=SERVICE, bindings=lambda: [], start_serving=False, on_started=on_started,
                             on_stopping=lambda _server: reconcilers.close())
    finally:
        for provisioner in provisioners:
            provisioner.close()
        supervisor.stop_all()
        registry.close()
