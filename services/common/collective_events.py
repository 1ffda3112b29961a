"""CollectiveEvent: one record per collective or point-to-point op (the coordinator's telemetry).

The fields and their order match ``telemetry.proto``'s ``CollectiveEvent`` message; the worker's
coordinator produces these and the telemetry service consumes them. Domain code never sees
protobuf: the conversion lives next to the gRPC code.
"""

from __future__ import annotations

import collections
import threading
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True, slots=True)
class CollectiveEvent:
    replica_group_id: str
    gpu_id: str
    op_type: str  # "all_reduce", "all_gather", "broadcast", "send", "recv", "barrier"
    bytes: int
    duration_ms: float
    group_size: int
    timestamp_ms: int
    timed_out: bool  # did not complete: its timeout fired, or (``peer_lost``) it failed for good first
    # its peer is gone (a closed connection, or the peer's node stopped reporting): final, no retry
    peer_lost: bool = False
    # the rank's count of ops on ``communicator`` ("tp/pp<stage>", "control"), from 1; 0 and ""
    # for point-to-point ops, whose counts on the two ends are not comparable
    seq: int = 0
    communicator: str = ""


def rank_gpu_id(replica_group_id: str, pp_stage: int, tp_rank: int) -> str:
    """How a rank is named in its events, the registry's shards and health: ``GROUP:pp<s>-tp<r>``."""
    return f"{replica_group_id}:pp{pp_stage}-tp{tp_rank}"


def tp_communicator(pp_stage: int) -> str:
    """The tensor-parallel communicator of a pipeline stage, as events name it."""
    return f"tp/pp{pp_stage}"


def communicator_members(replica_group_id: str, communicator: str, group_size: int) -> list[str]:
    """The ranks of a stage's tensor-parallel communicator (``group_size`` of them); [] for one
    whose members its name and size do not say (the group-wide "control")."""
    stage = communicator.removeprefix("tp/pp")
    if stage == communicator or not stage.isdigit():
        return []
    return [rank_gpu_id(replica_group_id, int(stage), r) for r in range(group_size)]


class EventSink(Protocol):
    def record(self, event: CollectiveEvent) -> None: ...


class RingBufferSink:
    """Keeps the newest ``capacity`` events in memory; counts what it had to drop."""

    def __init__(self, capacity: int = 100_000) -> None:
        self._events: collections.deque[CollectiveEvent] = collections.deque(maxlen=capacity)
        self._lock = threading.Lock()
        self.dropped = 0

    def record(self, event: CollectiveEvent) -> None:
        with self._lock:
            if len(self._events) == self._events.maxlen:
                self.dropped += 1
            self._events.append(event)

    def drain(self) -> list[CollectiveEvent]:
        with self._lock:
            events = list(self._events)
            self._events.clear()
            return events

    def snapshot(self) -> list[CollectiveEvent]:
        with self._lock:
            return list(self._events)

    def __len__(self) -> int:
        return len(self._events)
