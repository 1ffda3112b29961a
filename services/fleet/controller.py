"""The fleet controller: one loop that makes the registry's actual fleet match the applied spec.

Every tick it reads the newest applied revision and the fleet's replica groups (registry rows,
heartbeats, the provisioner's processes) and takes the next steps, none of which waits:

1. **Heal.** A group whose processes exited, whose driver marked it dead (a collective timed
   out), whose heartbeats stopped, that the health store marks unhealthy (telemetry's timeout
   rule), or that did not become ready in time, is marked ``dead`` with the reason and its
   processes are stopped. Step 3 then provisions a replacement from the same revision's plan.
   A group that fails while provisioning pages (a telemetry alert), and repeated failures back
   off (1 s, 2 s, ... 60 s).
2. **Admit.** A loaded group (``provisioning`` with an endpoint, its worker SERVING) goes into
   rotation (``healthy``). While groups of another plan are in rotation (a rollout), a group of
   the target plan first passes the quality gate against one of them; a candidate that fails is
   torn down and the rollout ends ``failed``, the old groups still serving.
3. **Count.** In steady state the target plan's groups are kept at the desired count
   (the spec's, or the autoscaler's within min/max). During a rollout, one surge group at a time
   (``max_surge``), and an old group is drained only once the groups in rotation would still be
   at least ``desired - max_unavailable`` without it, and ``settle_s`` after the last admission
   (so every router has seen the new group before the old one leaves).

A rollout whose target failed the gate leaves the fleet on the revision it came from until a new
spec is applied; ``rollout abort`` re-applies the previous revision's spec, which is rolled out
the same way.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from services.common.health import UNHEALTHY, HealthStore
from services.common.healthcheck import check
from services.common.registry import IN_ROTATION, Fenced, FleetRollout, ReplicaGroup, ShardRegistry, registry_group_id
from services.fleet import metrics
from services.fleet.autoscale import Autoscaler
from services.fleet.heartbeats import HeartbeatWatch
from services.fleet.jobs import GateOutcome, Jobs, drain_group, gate_candidate, recorded_gate
from services.fleet.load_signal import registry_utilization
from services.fleet.paging import Page
from services.fleet.provisioner import GroupLaunch, GroupProcess, Provisioner
from services.fleet.spec import FleetSpec
from services.quality.gate import golden_set_for
from services.quality.golden_set import GoldenSet

log = logging.getLogger(__name__)

UtilizationSource = Callable[[ShardRegistry, list[ReplicaGroup]], dict[str, float]]
Probe = Callable[[str], bool]  # endpoint -> its worker is SERVING
Gate = Callable[[str, str, "FleetSpec"], GateOutcome]  # (candidate, reference, target spec) -> verdict
Drain = Callable[..., int]  # drain_group's signature


def serving(endpoint: str) -> bool:
    try:
        return check(endpoint, timeout_s=1.0) == "SERVING"
    except Exception:  # noqa: BLE001 - not yet
        return False

HEARTBEAT_TIMEOUT_S = 10.0
STARTUP_TIMEOUT_S = 600.0
MAX_BACKOFF_S = 60.0


def new_group_name(fleet: str) -> str:
    return f"{fleet}-{uuid.uuid4().hex[:6]}"


@dataclass
class FleetState:
    """What the controller knows between ticks. None of it is needed to resume after a restart:
    a fresh controller reads the desired count off the fleet as it stands, waits a settle time
    before its first drain, resumes the drains it finds, and acts on the verdict recorded on a
    candidate it finds (or gates it, if none was recorded)."""

    desired: int | None = None
    admitted_at: float = float("-inf")  # last admission into rotation (a fresh controller: its start)
    failures: int = 0  # provisioning failures in a row
    retry_at: float = 0.0
    gates: dict[str, GateOutcome] = field(default_factory=dict)  # passed candidates, by name
    reference_scores: dict[str, Any] = field(default_factory=dict)  # the serving plan's, for this rollout
    utilization_pct: float | None = None
    events: deque[dict[str, Any]] = field(default_factory=lambda: deque(maxlen=500))  # the latest, for reports


class FleetController:
    def __init__(self, registry: ShardRegistry, provisioner: Provisioner, fleet: str, *, registry_url: str,
                 heartbeat_timeout_s: float = HEARTBEAT_TIMEOUT_S, startup_timeout_s: float = STARTUP_TIMEOUT_S,
                 clock: Callable[[], float] = time.monotonic, utilization: UtilizationSource | None = None,
                 probe: Probe = serving, gate: Gate | None = None, drain: Drain = drain_group,
                 health: HealthStore | None = None, page: Page | None = None,
                 say: Callable[[str], None] | None = None) -> None:
        self.registry = registry
        self.registry_url = registry_url
        self.provisioner = provisioner
        self.fleet = fleet
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.startup_timeout_s = startup_timeout_s
        self.clock = clock
        self.utilization = utilization or registry_utilization  # group name -> KV utilization (0..1)
        # how groups are looked at and acted on: the real ones talk to the workers' endpoints
        self.probe, self.gate, self.drain = probe, gate or self._gate_live, drain
        self.health = health  # the ranks' health as telemetry and the drivers see it (optional)
        self.page = page
        self.say = say or (lambda line: log.info("%s", line))
        # as if a group had just been admitted: a controller that starts mid-rollout (a restart, a
        # new leader) lets the routers see the fleet for a settle time before it drains anything
        self.state = FleetState(admitted_at=clock())
        self.jobs = Jobs()
        self.autoscaler = Autoscaler()
        self._specs: dict[int, FleetSpec] = {}
        self._golden: dict[tuple[Any, ...], GoldenSet] = {}
        self._started_at: dict[str, float] = {}
        self.heartbeats = HeartbeatWatch(heartbeat_timeout_s)

    # ---- reading ---------------------------------------------------------------------------

    def spec_of(self, revision: int) -> FleetSpec:
        spec = self._specs.get(revision)
        if spec is None:
            spec = self._specs[revision] = FleetSpec.from_json(self.registry.fleet_revision(self.fleet, revision).spec)
        return spec

    def event(self, kind: str, rollout: FleetRollout | None = None, **detail: Any) -> None:
        entry = {"t": round(time.time(), 3), "event": kind, **detail}
        self.state.events.append(entry)
        metrics.count_event(self.fleet, kind)
        words = " ".join(f"{k}={v}" for k, v in detail.items())
        self.say(f"fleet {self.fleet}: {kind} {words}")
        if rollout is not None:
            try:
                self.registry.update_rollout(rollout.rollout_id, event=entry)
            except Exception as exc:  # noqa: BLE001 - the log has it
                log.warning("rollout event not recorded: %s", exc)

    def _target(self, newest: int) -> tuple[int, FleetRollout | None]:
        """The revision to converge on (the newest, unless a rollout to it failed: then the one it
        came from), and the latest rollout."""
        rollouts = self.registry.list_rollouts(self.fleet)
        failed = [r for r in rollouts if r.to_revision == newest and r.status == "failed"]
        target = (failed[0].from_revision or newest) if failed else newest
        return target, (rollouts[0] if rollouts else None)

    # ---- one tick --------------------------------------------------------------------------

    def tick(self) -> None:
        now = self.clock()
        newest = self.registry.fleet_revision(self.fleet).revision
        rollout = self.registry.latest_rollout(self.fleet)
        if rollout is not None and rollout.status == "aborting":
            self._abort(rollout)
            newest = self.registry.fleet_revision(self.fleet).revision
        self._collect_jobs(rollout)  # first: a gate that failed changes the target
        target_rev, rollout = self._target(newest)
        spec = self.spec_of(target_rev)
        procs = {p.name: p for p in self.provisioner.groups()}
        groups = self._heal(self.registry.fleet_groups(self.fleet, include_dead=True), procs, now)
        key = spec.plan_key()
        mine = [g for g in groups if self.spec_of(g.fleet_revision or target_rev).plan_key() == key]
        others = [g for g in groups if g not in mine]
        others_in_rotation = [g for g in others if g.status in IN_ROTATION]
        rollout = self._track_rollout(rollout, target_rev, others_in_rotation, others)
        for g in others:  # candidates of a plan no longer wanted
            if g.status == "provisioning" and not self.jobs.running(g.name or ""):
                self._retire(g, "its plan is no longer the fleet's")
        for g in groups:  # a drain its controller did not finish (it stopped, or lost its lease)
            if g.status == "draining" and not self.jobs.running(g.name or ""):
                self._drain(g, g.status_reason or "a drain resumed", rollout)
        self._admit(spec, mine, others_in_rotation, rollout, now)
        desired = self._desired(spec, mine, others_in_rotation, now)
        self._count(spec, target_rev, mine, others_in_rotation, desired, rollout, now)

    def _abort(self, rollout: FleetRollout) -> None:
        if rollout.from_revision is None:
            self.registry.update_rollout(rollout.rollout_id, status="aborted", reason="nothing to return to")
            return
        back = self.spec_of(rollout.from_revision)
        revision, _ = self.registry.apply_fleet(self.fleet, back.to_json())
        self.registry.update_rollout(rollout.rollout_id, status="aborted",
                                     reason=f"aborted: revision {rollout.from_revision}'s spec re-applied as "
                                            f"revision {revision.revision}")
        self.event("rollout-aborted", rollout, to_revision=rollout.to_revision, back_as=revision.revision)

    def _collect_jobs(self, rollout: FleetRollout | None) -> None:
        for name, kind, future in self.jobs.finished():
            exc = future.exception()
            if kind == "gate":
                if exc is not None:
                    outcome = GateOutcome(name, "", False, {}, (f"the gate could not run: {exc}",))
                else:
                    outcome = future.result()
                self._gated(outcome, rollout)
            elif kind == "drain":
                self.event("drained", rollout, group=name,
                           handed_off=(None if exc is not None else future.result()))

    def _gated(self, outcome: GateOutcome, rollout: FleetRollout | None, *, recorded: bool = False) -> None:
        """Act on a verdict: this controller's gate's, or (``recorded``) one found in the registry."""
        how = {"recorded": True} if recorded else {}
        metrics.gate_figures(self.fleet, outcome.figures)
        if outcome.passed:
            self.state.gates[outcome.candidate] = outcome
            self.event("gate-passed", rollout, group=outcome.candidate, reference=outcome.reference,
                       **how, **outcome.figures)
            return
        reason = "failed the quality gate: " + "; ".join(outcome.reasons)
        self.event("gate-failed", rollout, group=outcome.candidate, reference=outcome.reference,
                   reasons=list(outcome.reasons), **how, **outcome.figures)
        self._mark_dead(outcome.candidate, reason[:500])
        self.provisioner.stop(outcome.candidate)
        if rollout is not None and rollout.status == "running":
            self.registry.update_rollout(rollout.rollout_id, status="failed", reason=reason[:500])

    # ---- heal ------------------------------------------------------------------------------

    def _mark_dead(self, name: str, reason: str) -> None:
        try:
            self.registry.set_status(registry_group_id(name), "dead", reason=reason, by="fleet")
        except Fenced:  # deposed: another controller decides now, so stop nothing either
            raise
        except Exception as exc:  # noqa: BLE001 - already dead (its driver said so first)
            log.info("group %s not marked dead: %s", name, exc)

    def _failure_of(self, g: ReplicaGroup, proc: GroupProcess | None, now: float) -> str | None:
        if proc is None:
            # not started by this controller: another one's, that led before this one (its processes
            # outlive its lease), or this one's before it restarted. Judged by what it shows, as
            # any group: in rotation its worker must answer; a provisioning one gets its start-up time
            if g.status in IN_ROTATION and not (g.endpoint and self.probe(g.endpoint)):
                return "not started by this controller, and its worker does not answer"
        elif not proc.alive:
            return proc.reason
        started = self._started_at.setdefault(g.name or "", now)
        if g.status == "provisioning" and now - started > self.startup_timeout_s:
            return f"not ready within {self.startup_timeout_s:g} s"
        if g.status in IN_ROTATION:
            shards = self.registry.shards_of(g.replica_group_id)
            if shards:
                silent = self.heartbeats.silent_for(g.name or "", max(s.last_heartbeat for s in shards), now)
                if silent > self.heartbeat_timeout_s:
                    return f"no heartbeat for {silent:.0f} s"
            unhealthy = self._unhealthy_ranks(g.name or "")
            if unhealthy:
                return f"the health store marks {', '.join(unhealthy)} unhealthy"
        return None

    def _unhealthy_ranks(self, name: str) -> list[str]:
        if self.health is None:
            return []
        try:
            ranks = self.health.group_health(name)
        except Exception as exc:  # noqa: BLE001 - a store outage is no verdict on the group
            log.warning("fleet %s: health store unreachable for %s: %s", self.fleet, name, exc)
            return []
        return sorted(rank for rank, status in ranks.items() if status == UNHEALTHY)

    def _heal(self, rows: list[ReplicaGroup], procs: dict[str, GroupProcess], now: float) -> list[ReplicaGroup]:
        """The fleet's live groups, after taking the failed ones out."""
        self.heartbeats.reading(now)
        self.heartbeats.keep_only(g.name or "" for g in rows if g.status != "dead")
        by_name = {g.name: g for g in rows}
        for name in ended(by_name, procs):
            if not self.jobs.running(name):
                self.provisioner.stop(name)
                if by_name.get(name) is not None:
                    self.event("stopped", group=name, reason=by_name[name].status_reason or "dead in the registry")
        live = []
        for g in rows:
            if g.status == "dead":
                continue
            # a group being drained is stopped by its drain job, whatever it looks like meanwhile
            draining = self.jobs.running(g.name or "") == "drain"
            reason = None if draining else self._failure_of(g, procs.get(g.name or ""), now)
            if reason is None:
                live.append(g)
                continue
            was_provisioning = g.status == "provisioning"
            self._mark_dead(g.name or str(g.replica_group_id), reason[:500])
            self.provisioner.stop(g.name or "")
            self.autoscaler.reset(now)
            if was_provisioning:
                self.state.failures += 1
                backoff = min(MAX_BACKOFF_S, 2.0 ** (self.state.failures - 1))
                self.state.retry_at = now + backoff
                log.error("fleet %s: group %s failed while provisioning: %s (next attempt in %g s)",
                          self.fleet, g.name, reason, backoff)
                if self.page is not None:
                    self.page(g.name or "", f"fleet {self.fleet}: group {g.name} failed while provisioning "
                                            f"{g.manifest_uri or ''}: {reason}"[:1000])
            self.event("dead", group=g.name, status=g.status, reason=reason)
        return live

    # ---- admit -----------------------------------------------------------------------------

    def _ready(self, g: ReplicaGroup) -> bool:
        return g.status == "provisioning" and bool(g.endpoint) and self.probe(g.endpoint or "")

    def _gate_live(self, candidate: str, reference: str, spec: FleetSpec) -> GateOutcome:
        return gate_candidate(candidate, reference, self._golden_for(spec), registry_url=self.registry_url,
                              threshold_pct=spec.rollout.gate_threshold_pct,
                              min_top1_agreement=spec.rollout.gate_min_top1,
                              reference_scores=self.state.reference_scores)

    def _admit(self, spec: FleetSpec, mine: list[ReplicaGroup], others_in_rotation: list[ReplicaGroup],
               rollout: FleetRollout | None, now: float) -> None:
        for g in mine:
            name = g.name or ""
            if not self._ready(g) or self.jobs.running(name):
                continue
            if others_in_rotation and name not in self.state.gates:
                recorded = recorded_gate(self.registry, name)  # gated before this controller started
                if recorded is not None:  # passed: in rotation on the next tick, as after our own gate
                    self._gated(recorded, rollout, recorded=True)
                    continue
                scored = [g.name for g in others_in_rotation if g.name in self.state.reference_scores]
                reference = scored[0] if scored else others_in_rotation[0].name or ""
                self.jobs.submit(name, "gate", self.gate, name, reference, spec)
                self.event("gating", rollout, group=name, reference=reference)
                continue
            try:
                self.registry.set_status(g.replica_group_id, "healthy", reason="in rotation", by="fleet")
            except Exception as exc:  # noqa: BLE001 - it failed meanwhile: the next tick heals it
                log.info("group %s not put in rotation: %s", name, exc)
                continue
            self.state.admitted_at = now
            self.state.failures = 0
            self.event("in-rotation", rollout if others_in_rotation else None, group=name,
                       startup_s=round(now - self._started_at.get(name, now), 1))

    def _golden_for(self, spec: FleetSpec) -> GoldenSet:
        g = spec.group
        policy = spec.rollout
        key = (g.source, policy.gate_chunks, policy.gate_chunk_tokens)
        if key not in self._golden:
            # deferred: the rank spec's module imports torch, which a controller needs only here
            from services.worker.runtime import RankSpec

            rank = RankSpec(None, checkpoint=g.manifest_uri) if g.manifest_uri else None
            self._golden[key] = golden_set_for(g.model_dir, rank, chunks=policy.gate_chunks,
                                               chunk_tokens=policy.gate_chunk_tokens)
        return self._golden[key]

    # ---- count -----------------------------------------------------------------------------

    def _desired(self, spec: FleetSpec, mine: list[ReplicaGroup], others_in_rotation: list[ReplicaGroup],
                 now: float) -> int:
        state = self.state
        rolling = bool(others_in_rotation)
        if spec.autoscaling is None:
            state.desired = spec.replicas
            return spec.replicas
        if state.desired is None:
            # the last decision, as the fleet embodies it: the groups of the plan (loading ones too),
            # or the old plan's in rotation mid-rollout; the spec's count for a fleet with none
            standing = max(sum(g.status in IN_ROTATION or g.status == "provisioning" for g in mine),
                           len(others_in_rotation))
            state.desired = spec.bounded(standing or spec.replicas)
        in_rotation = [g for g in mine if g.status in IN_ROTATION]
        by_group = self.utilization(self.registry, in_rotation)
        utils = [by_group.get(g.name or "", 0.0) for g in in_rotation]
        util = sum(utils) / len(utils) * 100 if utils else None
        state.utilization_pct = util
        if rolling or any(g.status == "provisioning" for g in mine):
            self.autoscaler.reset(now)  # a fleet in motion says nothing about the load
            return state.desired
        decision = self.autoscaler.decide(spec.autoscaling, now, util, state.desired)
        if decision.desired != state.desired:
            self.event("scale", desired=decision.desired, was=state.desired, reason=decision.reason,
                       utilization_pct=None if decision.utilization_pct is None else round(decision.utilization_pct, 1))
            state.desired = decision.desired
        return state.desired

    def _provision(self, spec: FleetSpec, revision: int, now: float, why: str,
                   rollout: FleetRollout | None = None) -> None:
        if now < self.state.retry_at:
            return
        name = new_group_name(self.fleet)
        plan = spec.group
        # the driver records the model's own name when it loads (the served name, else the config's)
        model = spec.served_model_name or self.fleet
        self.registry.create_replica_group(model, plan.tp_degree, plan.pp_degree, plan.dtype, 0, name=name,
                                           replica_group_id=registry_group_id(name), fleet_name=self.fleet,
                                           fleet_revision=revision, manifest_uri=plan.source, numerics=plan.numerics)
        self._started_at[name] = now
        self.provisioner.start(GroupLaunch(name, self.fleet, revision, plan, spec.served_model_name))
        self.event("provisioning", rollout, group=name, revision=revision, plan=plan.describe(), why=why)

    def _retire(self, g: ReplicaGroup, reason: str, rollout: FleetRollout | None = None) -> None:
        name = g.name or ""
        if g.status == "provisioning" or not g.endpoint:
            self._mark_dead(name, reason)
            self.provisioner.stop(name)
            self.event("stopped", rollout, group=name, reason=reason)
            return
        self._drain(g, reason, rollout)

    def _drain(self, g: ReplicaGroup, reason: str, rollout: FleetRollout | None = None) -> None:
        name = g.name or ""
        spec = self.spec_of(g.fleet_revision) if g.fleet_revision else None
        policy = spec.rollout if spec is not None else None
        self.jobs.submit(name, "drain", self.drain, self.registry, name, g.endpoint or "",
                         deadline_s=policy.drain_deadline_s if policy else 30.0,
                         settle_s=policy.settle_s if policy else 3.0, reason=reason, stop=self.provisioner.stop)
        self.event("draining", rollout, group=name, reason=reason)

    def _count(self, spec: FleetSpec, revision: int, mine: list[ReplicaGroup], others_in_rotation: list[ReplicaGroup],
               desired: int, rollout: FleetRollout | None, now: float) -> None:
        draining = {n for n, kind in self.jobs.kinds().items() if kind == "drain"}
        mine = [g for g in mine if g.name not in draining]
        others_in_rotation = [g for g in others_in_rotation if g.name not in draining]
        pending = [g for g in mine if g.status == "provisioning"]
        in_rotation = [g for g in mine if g.status in IN_ROTATION]
        if not others_in_rotation:
            if len(mine) < desired:
                self._provision(spec, revision, now, f"{len(mine)} of {desired} groups")
            elif len(in_rotation) > desired and not pending and not draining:
                self._retire(in_rotation[-1], f"scaled in to {desired}")
            return
        policy = spec.rollout
        # at most desired + max_surge groups (new ones, loading or not, and old ones in rotation) ...
        if len(mine) + len(others_in_rotation) < desired + policy.max_surge:
            self._provision(spec, revision, now, "rollout surge", rollout)
        # ... and at least desired - max_unavailable in rotation once an old one leaves
        rotation = len(in_rotation) + len(others_in_rotation)
        settled = now - self.state.admitted_at >= policy.settle_s
        if not draining and settled and rotation - 1 >= desired - policy.max_unavailable:
            self._retire(others_in_rotation[0], f"replaced by revision {revision}", rollout)

    # ---- rollouts --------------------------------------------------------------------------

    def _track_rollout(self, rollout: FleetRollout | None, target: int, others_in_rotation: list[ReplicaGroup],
                       others: list[ReplicaGroup]) -> FleetRollout | None:
        running = rollout is not None and rollout.status == "running"
        if others_in_rotation and not (running and rollout.to_revision == target):
            if running:
                self.registry.update_rollout(rollout.rollout_id, status="aborted",
                                             reason=f"superseded by revision {target}")
            source = max((g.fleet_revision or 0) for g in others_in_rotation) or None
            rollout = self.registry.create_rollout(self.fleet, source, target)
            self.state.gates.clear()
            self.state.reference_scores.clear()
            self.event("rollout-started", rollout, from_revision=source, to_revision=target,
                       plan=self.spec_of(target).group.describe())
        elif running and rollout.to_revision == target and not others:
            rollout = self.registry.update_rollout(rollout.rollout_id, status="succeeded", reason="") or rollout
            self.event("rollout-succeeded", rollout, to_revision=target)
        return rollout


def ended(rows: dict[str | None, ReplicaGroup], procs: Iterable[str]) -> list[str]:
    """The processes (by group name) whose group the registry says is dead, or no longer holds:
    they are to be stopped."""
    return [name for name in procs if rows.get(name) is None or rows[name].status == "dead"]


def tidy_own(registry: ShardRegistry, provisioner: Provisioner, fleet: str) -> list[str]:
    """What a standby controller still does: stop the processes it started (it led once) whose
    group has :func:`ended`, as the leader decided. It reads the registry and touches only its
    own processes, so it needs no lease."""
    rows = {g.name: g for g in registry.fleet_groups(fleet, include_dead=True)}
    stopped = ended(rows, [proc.name for proc in provisioner.groups()])
    for name in stopped:
        provisioner.stop(name)
    return stopped
