"""A replica group whose ranks live on several hosts, launched by torchrun.

``shardline serve worker --nnodes N --node-rank R --rdzv-endpoint HOST:PORT ...`` on each host
checks the launch against the plan's placement (:mod:`services.modeling.parallel.placement`:
node ``n`` runs ranks ``n·L … (n+1)·L − 1``, ``L`` ranks per node), then replaces itself with
``torchrun`` running the same command once per local rank, which is the same as typing::

    torchrun --nnodes N --node-rank R --nproc-per-node L --rdzv-backend static \\
             --rdzv-endpoint HOST:PORT --max-restarts 0 -m services.cli serve worker ...

The static rendezvous keeps the node ranks as given, so global rank 0 (the driver, the only rank
that serves gRPC and registers the group) is on node 0, where ``HOST`` must point. Under
torchrun each rank checks the placement again from torchrun's variables; rank 0 serves as a
driver whose followers joined by themselves, every other rank runs the follower loop and exits
when the driver stops the group or its collectives time out. A LeaderWorkerSet pod (one rank per
pod, services/fleet/kubernetes.py) sets the same variables in its manifest and runs the same way.

On hosts with several interfaces, tell gloo which one reaches the other hosts
(``GLOO_SOCKET_IFNAME``) and torchrun which address to advertise (``--local-addr``).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

import torch

from services.common.health import make_health_store
from services.modeling.parallel.placement import NodeRanks, PlacementError, check_launch
from services.telemetry.client import ShipperConfig
from services.worker.driver import follower_rank
from services.worker.launch import threads_per_rank
from services.worker.node_health import RankHeartbeat, rank_fields_of
from services.worker.runtime import RankSpec

log = logging.getLogger(__name__)

def add_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("multi-node groups (torchrun)")
    g.add_argument("--nnodes", type=int, default=None, help="hosts the group's ranks run on; with --node-rank and "
                   "--rdzv-endpoint this host's ranks start under torchrun (default: every rank on this host)")
    g.add_argument("--node-rank", type=int, default=0, help="this host's index, 0 for the driver's host")
    g.add_argument("--rdzv-endpoint", default=None, metavar="HOST:PORT",
                   help="node 0's address every host can reach, where the ranks meet")
    g.add_argument("--nproc-per-node", type=int, default=None,
                   help="ranks per host (default: TP x PP / --nnodes)")
    g.add_argument("--allow-cross-node-tp", action="store_true",
                   help="allow a TP group to span hosts (its all-reduces then run on the network)")
    g.add_argument("--local-addr", default=None, help="the address this host's torchrun agent advertises")


def under_launch() -> bool:
    """Started as one rank of a group of several by a launcher that set torchrun's variables:
    torchrun itself, or a LeaderWorkerSet pod (one rank per pod, the variables in its manifest)."""
    env = os.environ
    return (all(k in env for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "LOCAL_WORLD_SIZE"))
            and int(env["WORLD_SIZE"]) > 1)


def wants_launch(args: argparse.Namespace) -> bool:
    """Asked for a multi-node launch, and not yet under the torchrun it starts."""
    return args.nnodes is not None and "TORCHELASTIC_RUN_ID" not in os.environ


def run_follower(rank: int, spec: RankSpec, telemetry: ShipperConfig | None, health_url: str | None = None) -> int:
    """Rank ``rank`` of a torchrun-launched group: load this rank's shards, run the follower loop
    until the driver stops the group (0) or the group fails (1). With a health store, the rank
    beats for itself (services/worker/node_health.py)."""
    torch.set_num_threads(threads_per_rank(int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))
    heartbeat = None
    if health_url:
        heartbeat = RankHeartbeat(make_health_store(health_url), spec.replica_group_id,
                                  rank_fields_of([rank], spec.plan.tp_degree))
    try:
        follower_rank(rank, int(os.environ["WORLD_SIZE"]), spec, telemetry)
    except Exception:  # noqa: BLE001 - a collective timed out, a peer died, a shard failed to load
        log.exception("rank %d of replica group %s failed", rank, spec.replica_group_id)
        return 1
    finally:
        if heartbeat is not None:
            heartbeat.stop()
    return 0


def check(args: argparse.Namespace) -> NodeRanks:
    """This host's ranks for the flags (before the launch) or torchrun's variables (under it)."""
    tp, pp = args.tp, args.pp
    if under_launch():
        world, local = int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_WORLD_SIZE"])
        node = int(os.environ.get("GROUP_RANK", int(os.environ["RANK"]) // max(1, local)))
        return check_launch(tp, pp, nnodes=world // max(1, local), node_rank=node, local_world_size=local,
                            world_size=world, allow_cross_node_tp=args.allow_cross_node_tp)
    nnodes = args.nnodes
    if nnodes < 1:
        raise PlacementError(f"--nnodes must be >= 1, got {nnodes}")
    local = _ranks_per_node(args)
    if not args.rdzv_endpoint:
        raise PlacementError("--nnodes needs --rdzv-endpoint HOST:PORT (node 0's address)")
    return check_launch(tp, pp, nnodes=nnodes, node_rank=args.node_rank, local_world_size=local,
                        world_size=nnodes * local, allow_cross_node_tp=args.allow_cross_node_tp)


def _ranks_per_node(args: argparse.Namespace) -> int:
    return args.nproc_per_node or (args.tp * args.pp) // args.nnodes


def torchrun_argv(args: argparse.Namespace, command: list[str]) -> list[str]:
    """torchrun running ``shardline <command>`` (this process's own arguments) on this host's ranks."""
    local = _ranks_per_node(args)
    argv = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(args.nnodes),
            "--node-rank", str(args.node_rank), "--nproc-per-node", str(local), "--rdzv-backend", "static",
            "--rdzv-endpoint", args.rdzv_endpoint, "--max-restarts", "0"]
    if args.local_addr:
        argv += ["--local-addr", args.local_addr]
    return [*argv, "-m", "services.cli", *command]


def launch(args: argparse.Namespace) -> int:
    """Check the placement, then become torchrun (it does not return); 2 when refused."""
    try:
        here = check(args)
    except PlacementError as exc:
        print(f"shardline serve worker: refused: {exc}", flush=True)
        return 2
    argv = torchrun_argv(args, sys.argv[1:])
    print(f"shardline serve worker: node {here.node} of {args.nnodes}, ranks {list(here.ranks)}: "
          + " ".join(argv[1:]), flush=True)
    os.execv(sys.executable, argv)
    return 0  # not reached
