"""The controller's reconcile logic on a simulated fleet: a real registry (SQLite), a provisioner
whose groups "load" when the test says so, and gate/drain/probe stand-ins, on a clock the test
advances. What real processes cannot show quickly: the rollout policy at every tick, abort, a
failed gate, heal, and max_unavailable."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from services.common.health import MemoryHealthStore
from services.common.registry import IN_ROTATION, ShardRegistry, registry_group_id
from services.fleet.controller import FleetController
from services.fleet.jobs import GateOutcome, live_plan
from services.fleet.provisioner import GroupLaunch, GroupProcess
from services.fleet.spec import FleetSpec

pytestmark = pytest.mark.background  # in this process alone: the lane may run it at idle priority

FLEET = "sim"


class SimulatedProvisioner:
    """Groups that load on :meth:`load_all` (their driver adopts the row and registers a shard)."""

    def __init__(self, registry: ShardRegistry) -> None:
        self.registry = registry
        self.started: dict[str, GroupLaunch] = {}
        self.loaded: set[str] = set()
        self.exited: dict[str, str] = {}
        self.stopped: list[str] = []
        self.fail_with = ""  # set: every group started exits with it before loading
        self.silent: set[str] = set()  # loaded groups whose heartbeats stopped

    def start(self, launch: GroupLaunch) -> None:
        self.started[launch.name] = launch
        if self.fail_with:
            self.exited[launch.name] = self.fail_with

    def stop(self, name: str) -> None:
        if self.started.pop(name, None) is not None:
            self.stopped.append(name)

    def groups(self) -> list[GroupProcess]:
        return [GroupProcess(n, n not in self.exited, self.exited.get(n, "")) for n in self.started]

    def close(self) -> None:
        self.started.clear()

    def load_all(self) -> None:
        """Load the groups started since, and beat for every loaded one that is not silent."""
        for name in self.loaded & set(self.started) - self.silent:
            self.registry.heartbeat(f"{name}:0", 0)
        for name, launch in list(self.started.items()):
            if name in self.loaded or name in self.exited:
                continue
            plan = launch.plan
            gid = registry_group_id(name)
            self.registry.adopt_provisioning_group(gid, model_name=FLEET, tp_degree=plan.tp_degree,
                                                   pp_degree=plan.pp_degree, dtype=plan.dtype, kv_cache_cap_bytes=100,
                                                   endpoint=f"sim:{name}")
            self.registry.register_shard(gid, f"{name}:0", "node", 0, 0, 1)
            self.loaded.add(name)


def spec(**group: object) -> str:
    data = {"replica_group": {"name": FLEET, "checkpoint": {"model_dir": "/models/sim"}, **group}, "replicas": 2,
            "rollout": {"settle_s": 2, "drain_deadline_s": 1}}
    return FleetSpec.from_dict(data).to_json()


class Sim:
    def __init__(self, tmp: Path, *, failing_dtypes: tuple[str, ...] = ()) -> None:
        self.url = f"sqlite:///{tmp / 'registry.db'}"
        self.registry = ShardRegistry(self.url, migrate_schema=True)
        self.provisioner = SimulatedProvisioner(self.registry)
        self.now = 0.0
        self.gated: list[tuple[str, str]] = []
        self.failing_dtypes = failing_dtypes
        self.health = MemoryHealthStore()
        self.pages: list[tuple[str, str]] = []
        self.controller = self.new_controller()
        self.rotation: list[int] = []

    def restart(self) -> None:
        """A new controller process on the same registry: nothing of the old one's memory, its
        jobs gone with it; the groups (their processes) live on, and its provisioner finds them,
        as the Kubernetes one finds a fleet's LeaderWorkerSets."""
        self.controller = self.new_controller()

    def new_controller(self) -> FleetController:
        return FleetController(self.registry, self.provisioner, FLEET, registry_url=self.url,
                               clock=lambda: self.now, probe=lambda endpoint: True, gate=self.gate,
                               drain=self.drain, health=self.health,
                               page=lambda group, message: self.pages.append((group, message)),
                               say=lambda line: None)

    def gate(self, candidate: str, reference: str, target: FleetSpec) -> GateOutcome:
        """A verdict by the dtype, recorded in the registry as the live gate records it."""
        self.gated.append((candidate, reference))
        passed = target.group.dtype not in self.failing_dtypes
        reasons = () if passed else ("perplexity delta 5 % above 0.5 %",)
        delta = 0.0 if passed else 5.0
        self.registry.record_gate_result(
            model_name=FLEET, reference=live_plan(reference), candidate=live_plan(candidate),
            candidate_dtype=target.group.dtype, text_fingerprint="sim", chunks=1, scored_tokens=100,
            reference_perplexity=10.0, candidate_perplexity=10.0 * (1 + delta / 100), perplexity_delta_pct=delta,
            delta_low_pct=delta, delta_high_pct=delta, mean_abs_logprob_delta=0.0, p99_abs_logprob_delta=0.0,
            top1_agreement=1.0, threshold_pct=0.5, min_top1_agreement=None, passed=passed, reasons="\n".join(reasons))
        return GateOutcome(candidate, reference, passed, {"perplexity_delta_pct": delta}, reasons)

    def drain(self, registry: ShardRegistry, name: str, endpoint: str, *, reason: str, stop, **_: object) -> int:
        if registry.get_group(registry_group_id(name)).status != "draining":  # a resumed drain: it is already
            registry.set_status(registry_group_id(name), "draining", reason=reason, by="fleet")
        registry.set_status(registry_group_id(name), "dead", reason=reason, by="fleet")
        stop(name)
        return 0

    def apply(self, **group: object) -> int:
        return self.registry.apply_fleet(FLEET, spec(**group))[0].revision

    def groups(self) -> list:
        return self.registry.fleet_groups(FLEET)

    def in_rotation(self) -> int:
        return sum(g.status in IN_ROTATION for g in self.groups())

    def tick(self, n: int = 1) -> None:
        for _ in range(n):
            self.controller.tick()
            self.controller.jobs.wait_all(5.0)
            self.provisioner.load_all()
            self.rotation.append(self.in_rotation())
            self.now += 1.0

    def until(self, condition, limit: int = 60) -> None:
        for _ in range(limit):
            if condition():
                return
            self.tick()
        raise AssertionError(f"not reached in {limit} ticks: {[(g.name, g.status) for g in self.groups()]}")

    def rollout_status(self) -> str | None:
        rollout = self.registry.latest_rollout(FLEET)
        return rollout.status if rollout is not None else None

    def plans(self) -> set[tuple[int, int, str]]:
        return {(g.tp_degree, g.pp_degree, g.dtype) for g in self.groups()}


@pytest.fixture
def sim(tmp_path: Path):
    s = Sim(tmp_path)
    s.apply()
    s.until(lambda: s.in_rotation() == 2)
    s.rotation.clear()
    yield s
    s.registry.close()


def test_a_rollout_surges_one_gates_it_and_never_drops_below_the_desired_count(sim: Sim) -> None:
    sim.apply(pp_degree=2)
    sim.until(lambda: sim.rollout_status() == "succeeded")
    assert min(sim.rotation) >= 2 and max(sim.rotation) <= 3  # max_unavailable 0, max_surge 1
    assert sim.plans() == {(1, 2, "bf16")} and len(sim.groups()) == 2
    assert len(sim.gated) == 2 and all(ref != cand for cand, ref in sim.gated)
    events = [e["event"] for e in json.loads(sim.registry.latest_rollout(FLEET).events)]
    assert events.count("gate-passed") == 2 and events.count("draining") == 2 and events[-1] == "rollout-succeeded"


def test_a_resize_is_no_rollout(sim: Sim) -> None:
    data = json.loads(spec())
    data["replicas"] = 3
    sim.registry.apply_fleet(FLEET, json.dumps(data))
    sim.until(lambda: sim.in_rotation() == 3)
    assert sim.registry.latest_rollout(FLEET) is None and not sim.gated


def test_abort_returns_to_the_previous_plan_the_same_rolling_way(sim: Sim) -> None:
    sim.apply(pp_degree=2)
    sim.until(lambda: any(g.pp_degree == 2 and g.status == "healthy" for g in sim.groups()))
    rollout = sim.registry.latest_rollout(FLEET)
    sim.registry.update_rollout(rollout.rollout_id, status="aborting", only_if="running")
    sim.until(lambda: sim.plans() == {(1, 1, "bf16")} and sim.in_rotation() == 2 and len(sim.groups()) == 2)
    assert sim.registry.fleet_revision(FLEET).revision == 3  # revision 1's spec, applied again
    statuses = [r.status for r in sim.registry.list_rollouts(FLEET)]
    assert statuses[-1] == "aborted"
    sim.until(lambda: sim.rollout_status() == "succeeded")
    assert min(sim.rotation) >= 2


def test_a_failed_gate_ends_the_rollout_failed_and_nothing_more_is_tried(tmp_path: Path) -> None:
    sim = Sim(tmp_path, failing_dtypes=("int8",))
    sim.apply()
    sim.until(lambda: sim.in_rotation() == 2)
    serving = {g.name for g in sim.groups()}
    sim.apply(dtype="int8")
    sim.until(lambda: sim.rollout_status() == "failed")
    started = len(sim.provisioner.stopped) + len(sim.provisioner.started)
    sim.tick(10)
    assert {g.name for g in sim.groups()} == serving and sim.in_rotation() == 2
    assert len(sim.provisioner.stopped) + len(sim.provisioner.started) == started  # no new candidate
    assert "quality gate" in sim.registry.latest_rollout(FLEET).reason
    dead = [g for g in sim.registry.fleet_groups(FLEET, include_dead=True) if g.status == "dead"]
    assert len(dead) == 1 and "failed the quality gate" in dead[0].status_reason


def test_a_new_controller_acts_on_a_failed_verdict_recorded_by_its_predecessor(tmp_path: Path) -> None:
    s = Sim(tmp_path, failing_dtypes=("int8",))
    s.apply()
    s.until(lambda: s.in_rotation() == 2)
    s.apply(dtype="int8")
    s.until(lambda: bool(s.gated))  # the verdict is recorded; its controller dies before acting on it
    s.controller.jobs.wait_all(5.0)
    s.restart()
    s.until(lambda: s.rollout_status() == "failed")
    s.tick(5)
    [candidate] = {c for c, _ in s.gated}
    assert len(s.gated) == 1 and s.registry.get_group(registry_group_id(candidate)).status == "dead"
    assert [r.status for r in s.registry.list_rollouts(FLEET)] == ["failed"] and s.plans() == {(1, 1, "bf16")}
    events = [e for e in s.controller.state.events if e["event"] == "gate-failed"]
    assert events and events[0]["recorded"] is True
    s.registry.close()


def test_heal_replaces_a_group_whose_process_exited(sim: Sim) -> None:
    victim = sim.groups()[0].name
    sim.provisioner.exited[victim] = "worker process exited with code -9"
    sim.until(lambda: victim not in {g.name for g in sim.groups()} and sim.in_rotation() == 2)
    row = sim.registry.get_group(registry_group_id(victim))
    assert row.status == "dead" and row.status_reason == "worker process exited with code -9"
    assert victim in sim.provisioner.stopped and sim.registry.latest_rollout(FLEET) is None


def test_heal_replaces_a_group_the_health_store_marks_unhealthy(sim: Sim) -> None:
    victim = sim.groups()[0].name
    sim.health.heartbeat(victim, {"pp0_tp0": "unhealthy"})  # telemetry's collective-timeout rule
    sim.until(lambda: victim not in {g.name for g in sim.groups()} and sim.in_rotation() == 2)
    row = sim.registry.get_group(registry_group_id(victim))
    assert row.status == "dead" and row.status_reason == "the health store marks pp0_tp0 unhealthy"
    assert victim in sim.provisioner.stopped and not sim.pages  # it failed serving, not provisioning


def test_heal_replaces_a_group_whose_heartbeats_stopped(sim: Sim) -> None:
    victim = sim.groups()[0].name
    sim.provisioner.silent.add(victim)  # its process lives on, its heartbeats stop
    sim.tick(10)  # 10 s of silence on the controller's clock: not yet more than the timeout
    assert victim in {g.name for g in sim.groups()}
    sim.until(lambda: victim not in {g.name for g in sim.groups()} and sim.in_rotation() == 2)
    row = sim.registry.get_group(registry_group_id(victim))
    assert row.status == "dead" and row.status_reason == "no heartbeat for 11 s", row.status_reason
    assert victim in sim.provisioner.stopped


def test_silence_the_controller_did_not_watch_condemns_no_group(sim: Sim) -> None:
    """The controller (or the registry under it) stalled for 30 s, so nobody could beat: when it
    reads again, the old heartbeats start a new measure instead of killing groups that served."""
    names = {g.name for g in sim.groups()}
    sim.provisioner.silent |= names
    sim.tick(5)
    sim.now += 30.0  # a stalled controller process: no reading for 30 s
    sim.tick()
    sim.provisioner.silent.clear()  # the beats written during the stall land now
    sim.tick(20)
    assert {g.name for g in sim.groups()} == names and sim.in_rotation() == 2
    assert not sim.provisioner.stopped


def test_a_group_failing_while_provisioning_pages_and_retries_after_a_back_off(tmp_path: Path) -> None:
    s = Sim(tmp_path)
    s.provisioner.fail_with = "ShardChecksumError: model-tp00-pp00.safetensors: manifest says 1a2b, file is 3c4d"
    s.apply()
    s.tick(8)  # back-off 1, 2, 4 s between attempts: a handful of attempts, not one per tick
    dead = [g for g in s.registry.fleet_groups(FLEET, include_dead=True) if g.status == "dead"]
    assert 3 <= len(s.pages) <= 5 and len(dead) == len(s.pages)
    reasons = {g.name: g.status_reason for g in dead}
    for group, message in s.pages:
        assert s.provisioner.fail_with in message and f"group {group} failed while provisioning" in message
        assert reasons[group] == s.provisioner.fail_with
    assert len(reasons) == len(s.pages) and s.in_rotation() == 0
    s.registry.close()


def test_max_unavailable_without_surge_drains_first(sim: Sim) -> None:
    data = json.loads(spec(pp_degree=2))
    data["rollout"].update(max_surge=0, max_unavailable=1)
    sim.registry.apply_fleet(FLEET, json.dumps(data))
    sim.until(lambda: sim.rollout_status() == "succeeded")
    assert min(sim.rotation) >= 1 and max(sim.rotation) <= 2 and sim.plans() == {(1, 2, "bf16")}


# ---- a controller that restarts (or a new leader) converges as one that never stopped ----------


@pytest.mark.parametrize("moment", ["surge loading", "candidate gated", "old group draining"])
def test_a_controller_restarted_mid_rollout_finishes_it_once(sim: Sim, moment: str) -> None:
    sim.apply(pp_degree=2)
    reached = {
        "surge loading": lambda: any(g.pp_degree == 2 and g.status == "provisioning" for g in sim.groups()),
        "candidate gated": lambda: bool(sim.gated),
        "old group draining": lambda: any(g.pp_degree == 2 and g.status == "healthy" for g in sim.groups()),
    }[moment]
    sim.until(reached)
    if moment == "old group draining":  # a drain's first step done, then its controller died with the job
        victim = next(g.name for g in sim.groups() if g.pp_degree == 1 and g.status == "healthy")
        sim.registry.set_status(registry_group_id(victim), "draining", reason="replaced by revision 2", by="fleet")
    sim.restart()
    sim.until(lambda: sim.rollout_status() == "succeeded")
    sim.tick(5)
    assert sim.plans() == {(1, 2, "bf16")} and len(sim.groups()) == 2 and sim.in_rotation() == 2
    assert min(sim.rotation) >= 2 and max(sim.rotation) <= 3
    assert [r.status for r in sim.registry.list_rollouts(FLEET)] == ["succeeded"]
    # each candidate gated once: a verdict recorded before the restart is read, not run again
    assert len(sim.gated) == len({candidate for candidate, _ in sim.gated}) == 2


def test_a_restarted_controller_keeps_the_autoscalers_count_and_finishes_a_drain(tmp_path: Path) -> None:
    s = Sim(tmp_path)
    data = json.loads(spec())
    data["replicas"] = 1
    data["autoscaling"] = {"min_replicas": 1, "max_replicas": 4, "window_s": 3, "cooldown_s": 1}
    s.registry.apply_fleet(FLEET, json.dumps(data))
    s.controller.utilization = lambda registry, groups: {g.name: 0.95 for g in groups}  # a loaded fleet
    s.until(lambda: s.in_rotation() == 3)
    s.restart()  # with the same load: the new controller starts from the 3 it finds, not from 1
    s.controller.utilization = lambda registry, groups: {g.name: 0.5 for g in groups}  # between thresholds
    s.tick(10)
    assert s.in_rotation() == 3 and s.controller.state.desired == 3
    # a group left draining by a controller that stopped mid-drain is drained and stopped
    victim = s.groups()[0].name
    s.registry.set_status(registry_group_id(victim), "draining", reason="scaled in to 2", by="fleet")
    s.restart()
    s.until(lambda: victim not in {g.name for g in s.groups()})
    assert s.registry.get_group(registry_group_id(victim)).status == "dead" and victim in s.provisioner.stopped
    s.registry.close()


def test_a_controller_restarted_mid_heal_and_mid_scale_out_converges(tmp_path: Path) -> None:
    s = Sim(tmp_path)
    data = json.loads(spec())
    data["autoscaling"] = {"min_replicas": 2, "max_replicas": 4, "window_s": 3, "cooldown_s": 1}
    s.registry.apply_fleet(FLEET, json.dumps(data))
    s.until(lambda: s.in_rotation() == 2)
    # mid-heal: a group's process exited and was marked dead; the controller dies before replacing it
    victim = s.groups()[0].name
    s.provisioner.exited[victim] = "worker process exited with code -9"
    s.tick()
    assert victim not in {g.name for g in s.groups()}
    s.restart()
    s.until(lambda: s.in_rotation() == 2)
    # mid-scale-out: the third group is loading when the controller dies; the new one keeps it
    s.controller.utilization = lambda registry, groups: {g.name: 0.95 for g in groups}
    s.until(lambda: any(g.status == "provisioning" for g in s.groups()))
    loading = next(g.name for g in s.groups() if g.status == "provisioning")
    s.restart()
    s.controller.utilization = lambda registry, groups: {g.name: 0.5 for g in groups}
    s.until(lambda: s.in_rotation() == 3)
    s.tick(5)
    assert loading in {g.name for g in s.groups() if g.status == "healthy"} and s.in_rotation() == 3
    s.registry.close()
