"""What the autoscaler reads: each group's KV utilization, as the routers see it.

A router admits a request only where its whole KV estimate fits, so the cache a group can still
give is what routers have *committed* there (bytes in use plus what their admitted requests may
still claim), not only what the worker has filled so far: a fleet whose every group is committed
queues requests at the routers even while the workers' caches are half empty. So the signal is
``max over routers of committed / capacity`` per group, from every router's
``ListReplicaGroups``: each router's committed bytes count the claims the worker had admitted at
its last report from every router (the worker's ``kv_bytes_admitted``) plus its own since.
Without routers to ask, the registry's heartbeats give ``used / capacity`` (the workers' view),
which under-reads a fleet that routers hold back.
"""

from __future__ import annotations

import logging

import grpc

from services.common.proto import router_pb2, router_pb2_grpc
from services.common.registry import ReplicaGroup, ShardRegistry
from services.common.transport_security import open_channel

log = logging.getLogger(__name__)


def registry_utilization(registry: ShardRegistry, groups: list[ReplicaGroup]) -> dict[str, float]:
    out = {}
    for g in groups:
        shards = registry.shards_of(g.replica_group_id)
        if shards and g.kv_cache_cap_bytes > 0:
            out[g.name or ""] = min(1.0, max(s.kv_used_bytes for s in shards) / g.kv_cache_cap_bytes)
    return out


class RouterUtilization:
    """Committed KV per group, summed over the routers at ``addresses``."""

    def __init__(self, addresses: list[str], *, api_key: str | None = None, timeout_s: float = 2.0) -> None:
        self.addresses = list(addresses)
        self.metadata = [("authorization", f"Bearer {api_key}")] if api_key else None
        self.timeout_s = timeout_s

    def __call__(self, registry: ShardRegistry, groups: list[ReplicaGroup]) -> dict[str, float]:
        committed: dict[str, int] = {}
        capacity: dict[str, int] = {}
        answered = 0
        for address in self.addresses:
            try:
                with open_channel(address) as channel:
                    infos = router_pb2_grpc.RouterServiceStub(channel).ListReplicaGroups(
                        router_pb2.ListReplicaGroupsRequest(), timeout=self.timeout_s, metadata=self.metadata).groups
            except grpc.RpcError as exc:
                log.warning("router %s: ListReplicaGroups failed (%s); its reservations are not counted",
                            address, exc.code().name)
                continue
            answered += 1
            for info in infos:
                name = info.replica_group_id
                committed[name] = max(committed.get(name, 0), info.kv_bytes_used, info.kv_bytes_committed)
                capacity[name] = max(capacity.get(name, 0), info.kv_bytes_capacity)
        if not answered:
            return registry_utilization(registry, groups)
        return {name: min(1.0, committed[name] / capacity[name]) for name in committed if capacity.get(name)}
