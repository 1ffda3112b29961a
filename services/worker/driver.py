"""A serving replica group on this machine: the driver (this process, rank 0) and its followers.

Start-up loads every rank (followers in forked processes), builds the engine on the driver's
engine-loop thread and runs its loop there. While it serves, a heartbeat thread reports each
rank and the KV utilization to the health store and the registry (a silent rank's entry
expires). When a collective fails the engine stops, the group is marked unhealthy in the health
store and dead in the registry, and open streams end with UNAVAILABLE carrying the tokens
already produced.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from services.common.collective_events import rank_gpu_id
from services.common.health import make_health_store
from services.common.health.base import HealthStore, rank_fields
from services.common.registry import IN_ROTATION, registry_group_id
from services.modeling.parallel.placement import node_id
from services.telemetry.client import ShipperConfig, TelemetryShipper
from services.telemetry.instrument import instrument_engine
from services.telemetry.otel import current_metrics
from services.worker import node_health
from services.worker.engine.bootstrap import build_engine, start_rank
from services.worker.engine.engine import LLMEngine
from services.worker.engine.runner import StageRunner, follower_loop
from services.worker.engine_metrics import attach_engine_metrics
from services.worker.launch import Followers, threads_per_rank
from services.worker.runtime import RankSpec, weights_fingerprint

if TYPE_CHECKING:
    from services.common.registry import ShardRegistry

log = logging.getLogger(__name__)
HEARTBEAT_S = 1.0


def follower_rank(rank: int, world_size: int, spec: RankSpec, telemetry: ShipperConfig | None = None) -> None:
    shipper = TelemetryShipper(telemetry, node_id=node_id()) if telemetry is not None else None
    try:
        runner, _ = start_rank(spec, rank, sink=shipper)
        follower_loop(runner)
    finally:
        if shipper is not None:
            shipper.close()


def start_followers(spec: RankSpec, telemetry: ShipperConfig | None, *, fork: bool = False) -> Followers:
    """Ranks 1..N-1 of ``spec``'s group, started now. ``fork``: this process has run no tensor op
    yet, so they may fork from it rather than from a fork server (see :class:`Followers`)."""
    return Followers(spec.plan.world_size, follower_rank, spec, telemetry, fork=fork)


@dataclass
class ServingOptions:
    registry_url: str | None = None  # None: no registry (tests, bare worker)
    health_url: str | None = None  # redis://… ; None: no shared health store (the router polls Stats)
    endpoint: str = ""
    model_name: str = ""
    telemetry: ShipperConfig | None = None  # ship CollectiveEvents to a telemetry service
    # a fleet controller made the group's registry row and puts it in rotation itself (after
    # its checks): the group registers its shards and stays ``provisioning`` until then
    await_rotation: bool = False
    # the other ranks were started by torchrun (on this host or others) and join the env://
    # rendezvous themselves: the driver spawns none
    external_followers: bool = False


class ReplicaDriver:
    def __init__(self, spec: RankSpec, options: ServingOptions, *, followers: Followers | None = None) -> None:
        """``followers``: ranks 1..N-1, already started (:func:`start_followers`); else
        :meth:`start` starts them."""
        self.spec = spec
        self.options = options
        self.replica_group_id = spec.replica_group_id
        self.engine: LLMEngine | None = None
        self.followers = followers
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._threads: list[threading.Thread] = []
        self.registry: ShardRegistry | None = None
        self.health: HealthStore | None = None
        self.shipper: TelemetryShipper | None = None
        self._node_ids: tuple[str, ...] = ()
        self._watchdog: node_health.NodeWatchdog | None = None
        self._reported = threading.Lock()  # held once the failure is reported (by the loop or the watchdog)

    @functools.cached_property
    def weights_fingerprint(self) -> str:
        """Which weights the group serves (``runtime.weights_fingerprint``), computed once: a few
        MB of reads the first time it is asked."""
        return weights_fingerprint(self.spec)

    def start(self) -> LLMEngine:
        """Load rank 0 and build the engine on the engine-loop thread, which then runs it.

        One thread does all of this process's tensor work: OpenMP keeps a team of threads per
        thread that has run a parallel region, and with more team threads than cores its idle
        threads stop spinning and sleep between regions. A model loaded on the main thread and
        served from another made every batch-1 SmolLM2 step take 14-15 ms instead of 7.5."""
        plan = self.spec.plan
        if self.followers is None and plan.world_size > 1 and not self.options.external_followers:
            self.followers = start_followers(self.spec, self.options.telemetry)
        if self.options.telemetry is not None:
            self.shipper = TelemetryShipper(self.options.telemetry, node_id=node_id())
        built = threading.Event()
        outcome: list[tuple[StageRunner, LLMEngine] | BaseException] = []
        loop = threading.Thread(target=self._run_engine, args=(built, outcome), name="engine-loop", daemon=True)
        loop.start()
        built.wait()
        if isinstance(outcome[0], BaseException):
            loop.join()
            raise outcome[0]
        runner, self.engine = outcome[0]
        self._node_ids = runner.rt.node_ids
        try:
            instrument_engine(self.engine, self.replica_group_id, self.shipper)
            if current_metrics() is not None and current_metrics().metrics_port is not None:  # /metrics is served
                attach_engine_metrics(self.engine, self.options.model_name or self.spec.plan.config.name)
            self._register(runner.rt.loaded_bytes)
        except BaseException:
            self._stop.set()  # the loop thread, waiting for _ready, ends instead
            raise
        if self.health is not None and self.options.external_followers:
            self._watchdog = node_health.NodeWatchdog(runner.rt.coordinator, self.health, self.replica_group_id,
                                                      self._node_ids, plan.tp_degree, self._on_node_lost)
        self._ready.set()  # the loop starts serving once the engine is instrumented and registered
        beat = threading.Thread(target=self._heartbeat_loop, name="heartbeat", daemon=True)
        self._threads = [loop, beat]
        beat.start()
        return self.engine

    @property
    def healthy(self) -> bool:
        return self.engine is not None and self.engine.failure is None and not self._stop.is_set()

    def _run_engine(self, built: threading.Event, outcome: list) -> None:
        try:
            local = int(os.environ.get("LOCAL_WORLD_SIZE", 0)) if self.options.external_followers else 0
            torch.set_num_threads(threads_per_rank(local or self.spec.plan.world_size))
            runner, layout = start_rank(self.spec, 0, sink=self.shipper)
            outcome.append((runner, build_engine(self.spec, runner, layout)))
        except BaseException as exc:  # noqa: BLE001 - start() re-raises it on the caller's thread
            outcome.append(exc)
            return
        finally:
            built.set()
        while not self._ready.wait(0.5):
            if self._stop.is_set():
                return
        engine = outcome[0][1]
        engine.run(self._stop)
        if engine.failure is not None:
            self._report_failure(engine.failure)

    def _register(self, weight_bytes: int) -> None:
        opts = self.options
        if opts.health_url:
            self.health = make_health_store(opts.health_url)
        if not opts.registry_url:
            return
        plan = self.spec.plan
        # deferred: a worker started without a registry does not load SQLAlchemy
        from services.common.registry import ShardRegistry

        self.registry = ShardRegistry(opts.registry_url, migrate_schema=True)
        group_uuid = registry_group_id(self.replica_group_id)
        capacity = self.engine.layout.capacity_bytes
        model_name = opts.model_name or plan.config.name
        adopted = self.registry.adopt_provisioning_group(group_uuid, model_name=model_name, tp_degree=plan.tp_degree,
                                                         pp_degree=plan.pp_degree, dtype=plan.dtype,
                                                         kv_cache_cap_bytes=capacity, endpoint=opts.endpoint,
                                                         numerics=plan.numerics)
        if adopted is None:  # started by hand: the group makes its own row
            self.registry.create_replica_group(model_name, plan.tp_degree, plan.pp_degree, plan.dtype, capacity,
                                               name=self.replica_group_id, endpoint=opts.endpoint,
                                               replica_group_id=group_uuid, numerics=plan.numerics)
        for pp in range(plan.pp_degree):
            for tp in range(plan.tp_degree):  # each shard on its own rank's node
                self.registry.register_shard(group_uuid, rank_gpu_id(self.replica_group_id, pp, tp),
                                             self._node_ids[pp * plan.tp_degree + tp], tp, pp, weight_bytes)
        if not opts.await_rotation:
            self.registry.set_status(group_uuid, "healthy", by="driver")

    def _heartbeat_loop(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            if self.engine is None or self.engine.failure is not None:
                return
            stats = self.engine.stats()
            # each store on its own: one being down (restarting) must neither stop serving nor
            # hold back the other's heartbeat; the next beat retries on a fresh connection
            if self.health is not None:
                try:
                    self._beat_health(stats["kv_bytes_used"] / max(1, stats["kv_bytes_capacity"]))
                except Exception as exc:
                    log.warning("health store heartbeat failed: %s", exc)
            if self.registry is not None:
                try:
                    self._beat_registry(stats["kv_bytes_used"])
                except Exception as exc:
                    log.warning("registry heartbeat failed: %s", exc)

    def _beat_health(self, util: float) -> None:
        assert self.health is not None
        if self.options.external_followers:  # every node beats for its own ranks, with a short TTL
            own = [r for r, node in enumerate(self._node_ids) if node == self._node_ids[0]]
            node_health.beat(self.health, self.replica_group_id,
                             node_health.rank_fields_of(own, self.spec.plan.tp_degree))
        else:  # the followers live and die with this host: one beat for every rank
            plan = self.spec.plan
            node_health.beat(self.health, self.replica_group_id, rank_fields(plan.tp_degree, plan.pp_degree),
                             ttl_s=None)
        self.health.set_kv_utilization(self.replica_group_id, util)

    def _beat_registry(self, kv_bytes_used: int) -> None:
        assert self.registry is not None
        plan = self.spec.plan
        for pp in range(plan.pp_degree):
            for tp in range(plan.tp_degree):
                self.registry.heartbeat(rank_gpu_id(self.replica_group_id, pp, tp), kv_bytes_used)

    def _on_node_lost(self, failure: Exception, lost: list[str]) -> None:
        """The watchdog gave up on a stage-boundary op whose peer's node stopped reporting: the
        group fails now, while the engine thread still waits out the op."""
        assert self.engine is not None
        self.engine.fail(failure)
        self._report_failure(failure, lost=lost)

    def _report_failure(self, exc: Exception, *, lost: list[str] | None = None) -> None:
        """Mark the group unhealthy and dead, naming the lost node(s) of a multi-node group
        (``lost``, or found from the health store); once, whoever reports first."""
        if not self._reported.acquire(blocking=False):
            return
        log.error("replica group %s failed: %s", self.replica_group_id, exc)
        # each store on its own: Redis being down must not keep the registry from hearing it
        if self.health is not None:
            try:
                self.health.mark_group(self.replica_group_id, "unhealthy")
            except Exception as report_exc:
                log.warning("could not record the failure in the health store: %s", report_exc)
        reason = str(exc)
        if self.health is not None and self.options.external_followers and self._node_ids:
            try:  # which node stopped: its ranks' entries run out within a few seconds
                lost = lost or node_health.failed_nodes(self.health, self.replica_group_id, self._node_ids,
                                                        self.spec.plan.tp_degree)
                if lost:
                    reason = f"node {', '.join(lost)} stopped reporting; {reason}"
                    log.error("replica group %s lost node %s", self.replica_group_id, ", ".join(lost))
            except Exception as report_exc:
                log.warning("could not tell which node failed: %s", report_exc)
        if self.registry is not None:
            try:
                self.registry.set_status(registry_group_id(self.replica_group_id), "dead", reason=reason[:500],
                                         by="driver")
            except Exception as report_exc:
                log.warning("could not record the failure in the registry: %s", report_exc)

    def stop(self) -> None:
        self._stop.set()
        if self._watchdog is not None:
            self._watchdog.stop()
        for thread in self._threads:
            thread.join(timeout=10)
        if self.followers is not None:
            self.followers.join()
        if self.shipper is not None:
            self.shipper.close()
        if self.registry is not None and self.engine is not None and self.engine.failure is None:
            try:
                group = registry_group_id(self.replica_group_id)
                if self.registry.get_group(group).status in IN_ROTATION:
                    self.registry.set_status(group, "draining", by="driver")
                self.registry.set_status(group, "dead", reason="stopped", by="driver")
            except Exception as exc:
                log.warning("could not record the stop: %s", exc)
        if self.health is not None:
            try:
                self.health.remove_group(self.replica_group_id)
            except Exception as exc:  # the store is down: our entries expire with their TTL instead
                log.warning("could not remove the group from the health store: %s", exc)
