"""The controller's slow actions, each on its own thread so a reconcile tick never waits on one.

- :func:`gate_candidate`: the golden set scored on a candidate group and on a group of the
  serving revision (each through its worker's ``Score``), the gate's verdict, recorded in the
  registry (``quality_gate_results``), where :func:`recorded_gate` finds it again: a controller
  that starts after its predecessor gated a candidate acts on that verdict instead of gating again.
- :func:`drain_group`: out of rotation in the registry (routers stop sending it requests), the
  worker told to drain (it refuses new requests and finishes its own), and after the deadline
  the group is stopped: the streams it still holds end there and their routers continue them
  on the other groups.

The controller speaks to a group only through its WorkerService endpoint, never to a rank.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from services.common.proto import worker_pb2, worker_pb2_grpc
from services.common.registry import Fenced, QualityGateResult, ShardRegistry, registry_group_id
from services.common.transport_security import open_channel
from services.quality.gate import GateResult, PlanScores, record_gate, run_gate, score_live_group
from services.quality.golden_set import GoldenSet

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GateOutcome:
    candidate: str
    reference: str
    passed: bool
    figures: dict[str, Any]
    reasons: tuple[str, ...]


def live_plan(group: str) -> str:
    """How a serving group is named as a plan, to score it (``score_live_group``) and in the
    verdicts recorded on it."""
    return f"group={group}"


def gate_figures(result: GateResult | QualityGateResult) -> dict[str, Any]:
    """A verdict's figures for the rollout's events, from the gate's result or its record."""
    if isinstance(result, GateResult):
        c, v = result.comparison, result.verdict
        figures = (c.perplexity_delta_pct, *v.delta_interval_pct, v.threshold_pct, c.top1_agreement,
                   c.reference_perplexity, c.candidate_perplexity, c.scored_tokens)
    else:
        r = result
        figures = (r.perplexity_delta_pct, r.delta_low_pct, r.delta_high_pct, r.threshold_pct, r.top1_agreement,
                   r.reference_perplexity, r.candidate_perplexity, r.scored_tokens)
    delta, low, high, threshold, top1, ref_ppl, cand_ppl, scored = figures
    return {"perplexity_delta_pct": round(delta, 4), "delta_interval_pct": [round(low, 4), round(high, 4)],
            "threshold_pct": threshold, "top1_agreement": round(top1, 4),
            "reference_perplexity": round(ref_ppl, 4), "candidate_perplexity": round(cand_ppl, 4),
            "scored_tokens": scored}


def recorded_gate(registry: ShardRegistry, candidate: str) -> GateOutcome | None:
    """The newest verdict recorded on the serving group ``candidate``, or None (never gated, or
    its gate died with its controller before the verdict was written)."""
    verdicts = registry.list_gate_results(candidate=live_plan(candidate))
    if not verdicts:
        return None
    newest = verdicts[0]
    return GateOutcome(candidate, newest.reference.removeprefix(live_plan("")), newest.passed, gate_figures(newest),
                       tuple(line for line in newest.reasons.splitlines() if line))


def gate_candidate(candidate: str, reference: str, golden: GoldenSet, *, registry_url: str,
                   threshold_pct: float, min_top1_agreement: float | None,
                   reference_scores: dict[str, PlanScores]) -> GateOutcome:
    """``reference_scores`` keeps the serving plan's scores for the rollout's later candidates:
    the serving groups share one plan, and scoring one holds its engine for a prefill per chunk."""
    ref = reference_scores.get(reference)
    if ref is None:
        ref = reference_scores[reference] = score_live_group(live_plan(reference), golden, registry_url=registry_url)
    cand = score_live_group(live_plan(candidate), golden, registry_url=registry_url)
    result = run_gate(ref, cand, golden, threshold_pct=threshold_pct, min_top1_agreement=min_top1_agreement)
    try:
        record_gate(result, registry_url, migrate_schema=False)
    except Exception as exc:  # noqa: BLE001 - the verdict stands even if the registry missed it
        log.warning("gate verdict on %s not recorded: %s", candidate, exc)
    return GateOutcome(candidate, reference, result.verdict.passed, gate_figures(result),
                       tuple(result.verdict.reasons))


def drain_group(registry: ShardRegistry, name: str, endpoint: str, *, deadline_s: float, settle_s: float,
                reason: str, stop: Callable[[str], None]) -> int:
    """Drain and stop one group; the requests it still held at the deadline (handed off)."""
    gid = registry_group_id(name)
    try:
        registry.set_status(gid, "draining", reason=reason, by="fleet")
    except Fenced:  # the controller that decided this was deposed: its successor decides again
        raise
    except Exception as exc:  # noqa: BLE001 - already failing or gone: it is stopped below all the same
        log.warning("group %s: not marked draining (%s)", name, exc)
    # routers read the registry every few seconds: let them stop routing here first, so the
    # worker's own refusals (which the routers retry elsewhere) are rare
    time.sleep(min(settle_s, deadline_s))
    left = -1
    try:
        with open_channel(endpoint) as channel:
            stub = worker_pb2_grpc.WorkerServiceStub(channel)
            wait_s = max(0.0, deadline_s - settle_s)
            answer = stub.Drain(worker_pb2.DrainRequest(timeout_ns=int(wait_s * 1e9)), timeout=wait_s + 10)
            left = answer.in_flight
    except Exception as exc:  # noqa: BLE001 - a worker that cannot answer is stopped all the same
        log.warning("group %s: Drain failed (%s); stopping it", name, exc)
    try:
        registry.set_status(gid, "dead", reason=reason, by="fleet")
    except Exception as exc:  # noqa: BLE001
        log.warning("group %s: not marked dead (%s)", name, exc)
    stop(name)
    return left


class Jobs:
    """Background jobs by group name: at most one per group, results collected by the caller."""

    def __init__(self) -> None:
        self._jobs: dict[str, tuple[str, Future[Any]]] = {}
        self._lock = threading.Lock()

    def submit(self, name: str, kind: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> bool:
        with self._lock:
            if name in self._jobs:
                return False
            future: Future[Any] = Future()
            self._jobs[name] = (kind, future)

        def run() -> None:
            try:
                future.set_result(fn(*args, **kwargs))
            except BaseException as exc:  # noqa: BLE001 - handed to the controller's next tick
                future.set_exception(exc)
        threading.Thread(target=run, name=f"{kind}-{name}", daemon=True).start()
        return True

    def running(self, name: str) -> str | None:
        with self._lock:
            job = self._jobs.get(name)
        return job[0] if job is not None and not job[1].done() else None

    def kinds(self) -> dict[str, str]:
        with self._lock:
            return {name: kind for name, (kind, f) in self._jobs.items() if not f.done()}

    def finished(self) -> list[tuple[str, str, Future[Any]]]:
        """Jobs done since the last call (removed)."""
        with self._lock:
            done = [(name, kind, f) for name, (kind, f) in self._jobs.items() if f.done()]
            for name, _, _ in done:
                del self._jobs[name]
        return done

    def wait_all(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        with self._lock:
            futures = [f for _, f in self._jobs.values()]
        for f in futures:
            try:
                f.exception(timeout=max(0.0, deadline - time.monotonic()))
            except Exception:  # noqa: BLE001 - a timeout: the job is a daemon thread
                return
