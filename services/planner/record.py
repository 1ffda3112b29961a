"""Recording a chosen plan: a `provisioning` replica group in the shard registry.

The planner decides a layout; recording it hands the decision to whatever provisions workers
(they register their shards against the group and move it to `healthy`). The registry is opened
on first use, with its schema migrated, so a planner without a database still plans.
"""

from __future__ import annotations

import threading
import uuid

from sqlalchemy.engine import make_url

from services.common.errors import AlreadyExists, InvalidArgument
from services.common.registry import Conflict, ReplicaGroup, ShardRegistry, registry_url
from services.common.registry.errors import as_client_errors
from services.planner.cost_model import Candidate, check_layout
from services.planner.specs import PRESETS
from services.planner.topology import GIB

DEFAULT_KV_CACHE_CAP_BYTES = 20 * GIB


class ReplicaGroupExists(AlreadyExists):
    """The requested replica_group_id is already in the registry (a group id is never reused)."""


class PlanRecorder:
    """Creates replica groups in one registry (PostgreSQL, or the embedded SQLite default).

    ``url`` None means SHARDLINE_REGISTRY_URL, else ``sqlite:///$SHARDLINE_STATE_DIR/registry.db``.
    Thread-safe: gRPC handlers share one recorder.
    """

    def __init__(self, url: str | None = None) -> None:
        self.url = registry_url(url)
        self._registry: ShardRegistry | None = None
        self._lock = threading.Lock()

    @property
    def shown_url(self) -> str:
        return make_url(self.url).render_as_string(hide_password=True)

    def _open(self) -> ShardRegistry:
        with self._lock:
            if self._registry is None:
                with as_client_errors(f"shard registry at {self.shown_url}"):
                    self._registry = ShardRegistry(self.url, migrate_schema=True)
            return self._registry

    def record(self, model_name: str, candidate: Candidate, *, kv_cache_cap_bytes: int = 0,
               replica_group_id: str = "", name: str = "") -> ReplicaGroup:
        """Create the group in status ``provisioning``; ``kv_cache_cap_bytes`` 0 means 20 GiB and
        an empty ``replica_group_id`` a new UUID.

        A preset model name is checked against the layout first (TP must split its heads, PP
        must not exceed its layers), so a plan that cannot run is never recorded.
        """
        if not model_name.strip():
            raise InvalidArgument("model_name must not be empty")
        if kv_cache_cap_bytes < 0:
            raise InvalidArgument(f"kv_cache_cap_bytes must be ≥ 0, got {kv_cache_cap_bytes}")
        if model_name in PRESETS:
            check_layout(PRESETS[model_name], candidate)
        group_id: uuid.UUID | None = None
        if replica_group_id:
            try:
                group_id = uuid.UUID(replica_group_id)
            except ValueError:
                raise InvalidArgument(f"replica_group_id must be a UUID, got {replica_group_id!r}") from None
        registry = self._open()
        with as_client_errors(f"shard registry at {self.shown_url}", translate={Conflict: ReplicaGroupExists}):
            return registry.create_replica_group(
                model_name, candidate.tp, candidate.pp, candidate.dtype,
                kv_cache_cap_bytes or DEFAULT_KV_CACHE_CAP_BYTES, name=name or None, replica_group_id=group_id)

    def close(self) -> None:
        with self._lock:
            if self._registry is not None:
                self._registry.close()
                self._registry = None


__all__ = ["DEFAULT_KV_CACHE_CAP_BYTES", "PlanRecorder", "ReplicaGroupExists"]
