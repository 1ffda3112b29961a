"""Which node each rank of a replica group runs on, and the check a multi-node launch must pass.

Ranks are numbered ``global_rank = pp_stage · tp + tp_rank`` (:class:`ParallelGroups`) and fill
the nodes in order, ``ranks_per_node`` each: node ``n`` holds ranks ``n·R … (n+1)·R − 1``. So a
stage's TP group stays on one node when ``R`` is a multiple of ``tp`` (its all-reduces ride the
node's fast links), and pipeline stages map to nodes (the stage boundaries cross the network).
The planner prices a plan with this rule and prints it; a worker launched by torchrun across
nodes checks its launch against it before it loads anything.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass


class PlacementError(ValueError):
    """A launch that contradicts the plan's placement; the message names the plan."""


def node_of(rank: int, ranks_per_node: int) -> int:
    return rank // ranks_per_node


def node_id() -> str:
    """This rank's node as the registry records it (``gpu_shards.node_id``): ``SHARDLINE_NODE_ID``
    if set, else the host name, with ``-node<R>`` (torchrun's node rank) in a group launched on
    several nodes, so that two nodes with one host name (containers, namespaces) stay apart."""
    if explicit := os.environ.get("SHARDLINE_NODE_ID"):
        return explicit
    host = socket.gethostname()
    world, local = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("LOCAL_WORLD_SIZE", "0") or 0)
    if local and local < world and "GROUP_RANK" in os.environ:
        return f"{host}-node{os.environ['GROUP_RANK']}"
    return host


@dataclass(frozen=True)
class NodeRanks:
    node: int
    ranks: tuple[int, ...]
    stages: tuple[int, ...]  # the pipeline stages with a rank here

    def describe(self, tp: int) -> str:
        cells = ", ".join(f"{r} (pp{r // tp}-tp{r % tp})" for r in self.ranks)
        return f"node {self.node}: ranks {cells}"


def placement(tp: int, pp: int, ranks_per_node: int) -> list[NodeRanks]:
    """Every node's ranks for a TP × PP group on nodes of ``ranks_per_node`` ranks."""
    if tp < 1 or pp < 1 or ranks_per_node < 1:
        raise PlacementError(f"tp, pp and ranks per node must be >= 1, got {tp}, {pp}, {ranks_per_node}")
    world = tp * pp
    nodes = -(-world // ranks_per_node)
    out = []
    for n in range(nodes):
        ranks = tuple(range(n * ranks_per_node, min(world, (n + 1) * ranks_per_node)))
        out.append(NodeRanks(n, ranks, tuple(sorted({r // tp for r in ranks}))))
    return out


def tp_split_across_nodes(tp: int, pp: int, ranks_per_node: int) -> bool:
    """Whether some stage's TP group has ranks on two nodes."""
    return any(node_of(s * tp, ranks_per_node) != node_of((s + 1) * tp - 1, ranks_per_node) for s in range(pp))


def check_launch(tp: int, pp: int, *, nnodes: int, node_rank: int, local_world_size: int, world_size: int,
                 allow_cross_node_tp: bool = False) -> NodeRanks:
    """This node's ranks when the launch (torchrun's ``--nnodes``, node rank, ranks per node and
    world size) is the plan's; :class:`PlacementError` naming the plan otherwise."""
    plan = f"the plan TP={tp} x PP={pp} ({tp * pp} ranks)"
    if world_size != tp * pp:
        raise PlacementError(f"{plan} needs a world of {tp * pp} ranks; this launch has {world_size} "
                             f"({nnodes} node(s) x {local_world_size})")
    if nnodes * local_world_size != world_size:
        raise PlacementError(f"{plan}: {nnodes} node(s) x {local_world_size} ranks per node is not the "
                             f"world of {world_size}; every node must run the same number of ranks")
    nodes = placement(tp, pp, local_world_size)
    if len(nodes) != nnodes:
        raise PlacementError(f"{plan} on nodes of {local_world_size} ranks spans {len(nodes)} node(s), "
                             f"not the {nnodes} launched")
    if not 0 <= node_rank < nnodes:
        raise PlacementError(f"{plan}: node rank {node_rank} outside 0..{nnodes - 1}")
    if not allow_cross_node_tp and tp_split_across_nodes(tp, pp, local_world_size):
        raise PlacementError(
            f"{plan} on nodes of {local_world_size} ranks splits a TP group across nodes (its all-reduce "
            f"would run on the network at every layer): give each node a multiple of TP={tp} ranks, or pass "
            f"--allow-cross-node-tp; placement: " + "; ".join(n.describe(tp) for n in nodes))
    return nodes[node_rank]
