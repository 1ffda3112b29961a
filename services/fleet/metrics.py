"""The fleet controller's Prometheus series: what it wants, what it has, and why it scales."""

from __future__ import annotations

from collections import Counter as Tally

from prometheus_client import Counter, Gauge

from services.common.registry import GROUP_STATUSES, ReplicaGroup

DESIRED = Gauge("shardline_fleet_desired_replicas", "Replica groups the fleet controller wants in rotation",
                ["fleet"])
REPLICAS = Gauge("shardline_fleet_replicas", "Replica groups of the fleet by status", ["fleet", "status"])
KV_UTILIZATION = Gauge("shardline_fleet_kv_utilization_pct",
                       "Mean KV-cache utilization of the fleet's groups in rotation (the autoscaler's input)",
                       ["fleet"])
LEADER = Gauge("shardline_fleet_leader", "1 while this controller holds the fleet's lease and acts, else 0 "
               "(a standby)", ["fleet"])
LEASE_TERM = Gauge("shardline_fleet_lease_term", "The lease term this controller acts in (0: standby)", ["fleet"])
EVENTS = Counter("shardline_fleet_events_total", "Fleet controller actions by kind", ["fleet", "event"])
GATE_DELTA = Gauge("shardline_fleet_gate_perplexity_delta_pct", "The last quality gate's perplexity delta of the "
                   "fleet's candidate against its serving plan, 100 * (ppl_candidate / ppl_reference - 1)", ["fleet"])
GATE_TOP1 = Gauge("shardline_fleet_gate_top1_agreement", "The last quality gate's top-1 agreement of the fleet's "
                  "candidate with its serving plan (0..1)", ["fleet"])


def publish(fleet: str, desired: int | None, groups: list[ReplicaGroup], utilization_pct: float | None) -> None:
    if desired is not None:
        DESIRED.labels(fleet).set(desired)
    counts = Tally(g.status for g in groups)
    for status in GROUP_STATUSES:
        if status != "dead":
            REPLICAS.labels(fleet, status).set(counts.get(status, 0))
    if utilization_pct is not None:
        KV_UTILIZATION.labels(fleet).set(utilization_pct)


def count_event(fleet: str, event: str) -> None:
    EVENTS.labels(fleet, event).inc()


def gate_figures(fleet: str, figures: dict) -> None:
    """A gate's verdict figures (``GateOutcome.figures``), when it ran."""
    if "perplexity_delta_pct" in figures:
        GATE_DELTA.labels(fleet).set(figures["perplexity_delta_pct"])
    if "top1_agreement" in figures:
        GATE_TOP1.labels(fleet).set(figures["top1_agreement"])


def leading(fleet: str, term: int | None) -> None:
    LEADER.labels(fleet).set(1 if term is not None else 0)
    LEASE_TERM.labels(fleet).set(term or 0)
