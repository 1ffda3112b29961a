"""How the fleet controller gets replica groups made and unmade: the provisioner interface.

The controller decides *which* groups should exist; a provisioner turns one :class:`GroupLaunch`
into running processes (local ``shardline serve worker`` process groups, or a Kubernetes
LeaderWorkerSet) and takes them away again. It never decides anything: a group it started
registers itself in the registry and the routers discover it there, as every group does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from services.common.numerics import DEFAULT_NUMERICS
from services.fleet.spec import GroupPlan


@dataclass(frozen=True)
class GroupLaunch:
    """One replica group to start: its name (the ``--replica-group-id``), the fleet revision it is
    built from, and the plan of that revision."""

    name: str
    fleet: str
    revision: int
    plan: GroupPlan
    served_model_name: str | None = None

    def worker_flags(self) -> list[str]:
        """The ``shardline serve worker`` flags that make this group (the port and the shared
        services' addresses are the provisioner's)."""
        plan = self.plan
        flags = ["--replica-group-id", self.name, "--tp", str(plan.tp_degree), "--pp", str(plan.pp_degree),
                 "--dtype", plan.dtype, "--await-rotation"]
        flags += ["--checkpoint", plan.manifest_uri] if plan.manifest_uri else ["--model", str(plan.model_dir)]
        if plan.kv_cache_cap_gb is not None:
            flags += ["--kv-cache-gb", f"{plan.kv_cache_cap_gb:g}"]
        if plan.max_concurrent_sequences is not None:
            flags += ["--max-num-seqs", str(plan.max_concurrent_sequences)]
        if plan.collective_timeout_s is not None:
            flags += ["--collective-timeout", f"{plan.collective_timeout_s:g}"]
        if not plan.prefix_caching:
            flags.append("--no-prefix-caching")
        if plan.numerics != DEFAULT_NUMERICS:
            flags += ["--numerics", plan.numerics]
        if self.served_model_name:
            flags += ["--served-model-name", self.served_model_name]
        return flags


@dataclass(frozen=True)
class GroupProcess:
    """What a provisioner knows of a group it started."""

    name: str
    alive: bool
    reason: str = ""  # why it is not alive (an exit code), empty while it is
    endpoint: str = ""  # where its driver serves gRPC, once known


class Provisioner(Protocol):
    def start(self, launch: GroupLaunch) -> None:
        """Start the group's processes; returns at once (the group registers when it has loaded)."""

    def stop(self, name: str) -> None:
        """Stop the group's processes (SIGTERM, then SIGKILL after a grace period); idempotent."""

    def groups(self) -> list[GroupProcess]:
        """Every group this provisioner started and has not been told to stop."""

    def close(self) -> None:
        """Stop everything it started."""
