"""Collective and point-to-point time models (α–β), and which link a group actually spans.

Ring all-reduce of S bytes over n ranks, each link with bus bandwidth B and per-hop latency α:
the message is cut into n chunks, each travels n−1 hops to be summed (reduce-scatter) and n−1
more to be shared (all-gather), so

    t_all_reduce(S, n) = 2(n−1)/n · S/B  +  2(n−1) · α            (0 when n = 1)

At decode S is one token's hidden vector per sequence (8,192 × 2 B = 16 KiB for Llama-3-70B),
so the latency term dominates; at prefill S is megabytes and the bandwidth term does.

Ring all-gather (every rank contributes S/n, ends with S):

    t_all_gather(S, n) = (n−1)/n · S/B  +  (n−1) · α

Point-to-point send/recv of S bytes across one pipeline-stage boundary:

    t_send_recv(S) = α + S/B
"""

from __future__ import annotations

from dataclasses import dataclass

from services.modeling.parallel.placement import node_of
from services.planner.topology import Topology


class LinkError(ValueError):
    """A link with a non-positive bandwidth or a negative latency."""


@dataclass(frozen=True)
class Link:
    """One kind of link: its bus bandwidth per GPU (bytes/s) and per-hop latency (s)."""

    name: str  # "nvlink" (inside the NVLink domain) or "network" (between nodes)
    bandwidth_bytes_per_s: float
    latency_s: float

    def __post_init__(self) -> None:
        if self.bandwidth_bytes_per_s <= 0:
            raise LinkError(f"link {self.name}: bandwidth must be > 0, got {self.bandwidth_bytes_per_s}")
        if self.latency_s < 0:
            raise LinkError(f"link {self.name}: latency must be ≥ 0, got {self.latency_s}")


def ring_all_reduce_s(message_bytes: float, num_ranks: int, link: Link) -> float:
    """2(n−1)/n · S/B + 2(n−1)·α; zero for a group of one (the TP=1 path skips the collective)."""
    if num_ranks <= 1:
        return 0.0
    n = num_ranks
    return 2 * (n - 1) / n * message_bytes / link.bandwidth_bytes_per_s + 2 * (n - 1) * link.latency_s


def ring_all_gather_s(total_bytes: float, num_ranks: int, link: Link) -> float:
    """(n−1)/n · S/B + (n−1)·α for a gathered result of S bytes; zero for one rank."""
    if num_ranks <= 1:
        return 0.0
    n = num_ranks
    return (n - 1) / n * total_bytes / link.bandwidth_bytes_per_s + (n - 1) * link.latency_s


def send_recv_s(message_bytes: float, link: Link) -> float:
    """α + S/B for one point-to-point transfer."""
    return link.latency_s + message_bytes / link.bandwidth_bytes_per_s


def intra_node_link(topology: Topology) -> Link:
    return Link("nvlink", topology.intra_node_bandwidth_bytes_per_s, topology.intra_node_latency_s)


def inter_node_link(topology: Topology) -> Link:
    return Link("network", topology.inter_node_bandwidth_bytes_per_s, topology.inter_node_latency_s)


def _domain(topology: Topology, rank: int) -> tuple[int, int]:
    """(node, NVLink domain inside the node) of a global rank."""
    node = node_of(rank, topology.gpus_per_node)
    return node, (rank - node * topology.gpus_per_node) // topology.nvlink_domain_size


def tp_links(topology: Topology, tp: int, pp: int) -> list[Link]:
    """The link each stage's TP ring runs on.

    Ranks are laid out ``global_rank = pp_stage · tp + tp_rank``, so stage s's TP group is ranks
    ``s·tp … (s+1)·tp − 1``. A group inside one NVLink domain rides NVLink; a group that
    straddles domains (larger than a domain, or unluckily placed across a node boundary) runs
    at network speed, since a ring is as slow as its slowest hop.
    """
    links: list[Link] = []
    for s in range(pp):
        first, last = s * tp, (s + 1) * tp - 1
        inside = _domain(topology, first) == _domain(topology, last) and tp <= topology.nvlink_domain_size
        links.append(intra_node_link(topology) if inside else inter_node_link(topology))
    return links


def pp_boundary_links(topology: Topology, tp: int, pp: int) -> list[Link]:
    """The link each of the pp−1 stage boundaries crosses.

    The last rank of stage s is ``(s+1)·tp − 1`` and the first of stage s+1 is ``(s+1)·tp``;
    the boundary crosses the network when those two ranks sit on different nodes.
    """
    gpn = topology.gpus_per_node
    links: list[Link] = []
    for s in range(pp - 1):
        left, right = (s + 1) * tp - 1, (s + 1) * tp
        same_node = left // gpn == right // gpn
        links.append(intra_node_link(topology) if same_node else inter_node_link(topology))
    return links


def result_return_link(topology: Topology, tp: int, pp: int) -> Link | None:
    """The link sampled tokens take from the last stage's leader (rank (pp−1)·tp) back to the
    driver (rank 0); None when pp = 1 (the driver samples itself)."""
    if pp <= 1:
        return None
    leader = (pp - 1) * tp
    same_node = leader // topology.gpus_per_node == 0
    return intra_node_link(topology) if same_node else inter_node_link(topology)


__all__ = [
    "Link",
    "LinkError",
    "inter_node_link",
    "intra_node_link",
    "pp_boundary_links",
    "result_return_link",
    "ring_all_gather_s",
    "ring_all_reduce_s",
    "send_recv_s",
    "tp_links",
]
