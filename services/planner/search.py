"""Plan search: enumerate shard layouts, judge each, pick one by a stated objective, explain all.

Candidates are every (tp, pp, dtype) with

    tp  dividing the attention heads (and the MLP width, and dividing or divisible by the KV heads),
        at most the NVLink domain unless ``allow_cross_node_tp``;
    pp  from 1 to the layer count, with tp · pp ≤ max_nodes · gpus_per_node;
    dtype from the request (``any`` = all of them).

A candidate is feasible when, on its fullest stage, ``weights + reserve + kv_cap ≤ gpu_memory``
and the KV cap holds at least one sequence of the average context. Objectives:

    cost       lowest $ per million output tokens
    latency    lowest predicted TPOT at batch 1
    balanced   (default) the cheapest plan whose TPOT is within ``latency_band`` (10 %) of the
               best TPOT; costs within ``cost_tie_tolerance`` (2 %) count as a tie, broken
               toward the smaller TP group (a smaller collective and blast radius)

Every candidate carries a one-line verdict: why it was chosen, why it lost, or why it was
rejected (with the shortfall in bytes for memory).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Literal

from services.common.dtypes import canonical_dtype
from services.common.errors import FailedPrecondition, InvalidArgument
from services.planner.cost_model import Candidate, CostEstimate, CostModel, LayoutError, Workload, check_layout
from services.planner.specs import DTYPES, ModelSpec, SpecError
from services.planner.topology import GIB, Topology

Objective = Literal["cost", "latency", "balanced"]
OBJECTIVES: tuple[str, ...] = ("balanced", "cost", "latency")


class PlannerError(InvalidArgument):
    """Base class of planner failures that a caller should show to a user (a ValueError;
    INVALID_ARGUMENT over gRPC unless a subclass says otherwise)."""


class NoFeasiblePlanError(FailedPrecondition, PlannerError):
    """No candidate fits; carries the closest one and how far it is from fitting.

    FAILED_PRECONDITION over gRPC (FailedPrecondition comes first in the MRO): the request is
    well formed, the hardware cannot hold the model as asked."""

    def __init__(self, message: str, *, closest: Assessment | None, assessments: list[Assessment]) -> None:
        super().__init__(message)
        self.closest = closest
        self.assessments = assessments

    @property
    def shortfall_bytes(self) -> int | None:
        return self.closest.shortfall_bytes if self.closest else None


@dataclass(frozen=True)
class PlanRequest:
    """Everything a plan search depends on."""

    model: ModelSpec
    topology: Topology
    dtypes: tuple[str, ...] = ("float16",)
    workload: Workload = field(default_factory=Workload)
    objective: str = "balanced"
    max_nodes: int = 1
    allow_cross_node_tp: bool = False
    tp: int | None = None  # fix the TP degree (evaluate one layout when pp is fixed too)
    pp: int | None = None
    latency_band: float = 0.10
    cost_tie_tolerance: float = 0.02

    def __post_init__(self) -> None:
        if not self.dtypes:
            raise PlannerError("dtypes is empty; expected at least one dtype")
        object.__setattr__(self, "dtypes", tuple(canonical_dtype(d, error=SpecError) for d in self.dtypes))
        if self.objective not in OBJECTIVES:
            raise PlannerError(f"unknown objective {self.objective!r}; expected one of {', '.join(OBJECTIVES)}")
        if not isinstance(self.max_nodes, int) or self.max_nodes < 1:
            raise PlannerError(f"max_nodes must be a positive integer, got {self.max_nodes!r}")
        for name in ("tp", "pp"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise PlannerError(f"{name} must be a positive integer, got {value!r}")
        if not 0 <= self.latency_band < 10:
            raise PlannerError(f"latency_band must be a fraction in [0, 10), got {self.latency_band}")
        if not 0 <= self.cost_tie_tolerance < 1:
            raise PlannerError(f"cost_tie_tolerance must be in [0, 1), got {self.cost_tie_tolerance}")

    @property
    def max_gpus(self) -> int:
        return self.max_nodes * self.topology.gpus_per_node


@dataclass
class Assessment:
    """One candidate, judged: its figures (when it can shard the model), feasibility and verdict."""

    candidate: Candidate
    estimate: CostEstimate | None
    rejected_reason: str | None = None
    verdict: str = ""
    chosen: bool = False

    @property
    def feasible(self) -> bool:
        return self.rejected_reason is None

    @property
    def shortfall_bytes(self) -> int | None:
        if self.estimate is None or self.estimate.fits:
            return None
        return self.estimate.shortfall_bytes


@dataclass(frozen=True)
class PlanResult:
    request: PlanRequest
    chosen: Assessment
    assessments: list[Assessment]

    @property
    def feasible(self) -> list[Assessment]:
        return [a for a in self.assessments if a.feasible]


def _gib(n: float) -> str:
    return f"{n / GIB:.2f} GiB"


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def enumerate_candidates(request: PlanRequest) -> list[Candidate]:
    """Every layout the request allows, before judging memory (see module docstring)."""
    m = request.model
    if request.tp is not None:
        tps = [request.tp]
    else:
        tps = [t for t in _divisors(m.num_attention_heads) if t <= request.max_gpus]
    out: list[Candidate] = []
    for dtype in request.dtypes:
        for tp in tps:
            if request.pp is not None:
                pps = [request.pp]
            else:
                pps = list(range(1, min(m.num_layers, request.max_gpus // tp) + 1))
            out.extend(Candidate(tp, pp, dtype) for pp in pps)
    return out


def assess(request: PlanRequest, candidate: Candidate, cost_model: CostModel | None = None) -> Assessment:
    """Judge one candidate: structural checks, budget, NVLink placement, memory, KV capacity."""
    model, topo = request.model, request.topology
    cm = cost_model or CostModel(model, topo, request.workload)
    try:
        check_layout(model, candidate)
    except LayoutError as exc:
        return Assessment(candidate, None, rejected_reason=str(exc), verdict=f"rejected: {exc}")
    estimate = cm.estimate(candidate)
    reason: str | None = None
    if candidate.gpus > request.max_gpus:
        reason = (
            f"needs {candidate.gpus} GPUs, the budget is {request.max_gpus} "
            f"({request.max_nodes} node(s) × {topo.gpus_per_node}); raise --max-nodes"
        )
    elif candidate.tp > topo.nvlink_domain_size and not request.allow_cross_node_tp:
        reason = (
            f"TP group of {candidate.tp} exceeds the NVLink domain of {topo.nvlink_domain_size}: its "
            f"{2 * model.num_layers} all-reduces per token would cross the network "
            "(pass --allow-cross-node-tp to consider it)"
        )
    elif not estimate.fits:
        reason = (
            f"out of memory: needs {_gib(estimate.memory_needed_bytes)} per GPU "
            f"(weights {_gib(estimate.weight_bytes_per_gpu)} + reserve {_gib(topo.reserve_bytes)} + "
            f"KV cap {_gib(request.workload.kv_cap_bytes)}), has {_gib(topo.gpu_memory_bytes)}: "
            f"short by {estimate.shortfall_bytes:,} B"
        )
    elif estimate.max_concurrent_sequences < 1:
        reason = (
            f"KV cap holds {estimate.kv_tokens_per_gpu:,} tokens per GPU, less than one "
            f"{request.workload.avg_context:,}-token sequence"
        )
    verdict = f"rejected: {reason}" if reason else ""
    return Assessment(candidate, estimate, rejected_reason=reason, verdict=verdict)


def _dtype_rank(dtype: str) -> int:
    return list(DTYPES).index(dtype)


def _tie_key(a: Assessment) -> tuple[int, int, int]:
    """Smaller TP group, then fewer GPUs, then the dtype order of DTYPES."""
    return (a.candidate.tp, a.candidate.gpus, _dtype_rank(a.candidate.dtype))


def _cost(a: Assessment) -> float:
    assert a.estimate is not None and a.estimate.usd_per_million_tokens is not None
    return a.estimate.usd_per_million_tokens


def _tpot(a: Assessment) -> float:
    assert a.estimate is not None
    return a.estimate.tpot_batch1_s


def _tied_on_cost(pool: list[Assessment], tolerance: float) -> list[Assessment]:
    """The plans whose cost is within ``tolerance`` of the cheapest in ``pool``."""
    best_cost = min(_cost(a) for a in pool)
    return [a for a in pool if _cost(a) <= best_cost * (1 + tolerance)]


def choose(request: PlanRequest, feasible: list[Assessment]) -> Assessment:
    """Apply the objective to the feasible candidates and write every verdict."""
    best_tpot = min(_tpot(a) for a in feasible)
    tol = request.cost_tie_tolerance
    band_limit = best_tpot * (1 + request.latency_band)
    tied: list[Assessment] = []
    if request.objective == "latency":
        chosen = min(feasible, key=lambda a: (_tpot(a), _tie_key(a)))
    else:
        pool = feasible if request.objective == "cost" else [a for a in feasible if _tpot(a) <= band_limit]
        tied = _tied_on_cost(pool, tol)
        chosen = min(tied, key=lambda a: (_tie_key(a), _cost(a)))
    chosen.chosen = True

    c_cost, c_tpot = _cost(chosen), _tpot(chosen)
    band_pct = f"{request.latency_band:.0%}"
    if request.objective == "cost":
        why = f"lowest $/M output tokens (${c_cost:.3f})"
    elif request.objective == "latency":
        why = f"lowest TPOT at batch 1 ({c_tpot * 1e3:.2f} ms)"
    else:
        why = (
            f"cheapest (${c_cost:.3f}/M output tokens) within {band_pct} of the best TPOT "
            f"({best_tpot * 1e3:.2f} ms; this plan {c_tpot * 1e3:.2f} ms)"
        )
    if len(tied) > 1:
        why += f"; {len(tied) - 1} other plan(s) cost within {tol:.0%} and the tie goes to the smaller TP group"
    chosen.verdict = f"chosen: {why}"

    for a in feasible:
        if a is chosen:
            continue
        a_cost, a_tpot = _cost(a), _tpot(a)
        cost_delta = (a_cost / c_cost - 1) * 100
        tpot_delta = (a_tpot / c_tpot - 1) * 100
        if request.objective == "latency":
            if a_tpot > c_tpot:
                a.verdict = f"slower: TPOT {a_tpot * 1e3:.2f} ms vs {c_tpot * 1e3:.2f} ms ({tpot_delta:+.1f}%)"
            else:
                a.verdict = f"same TPOT ({a_tpot * 1e3:.2f} ms); the tie goes to the smaller TP group"
            continue
        if request.objective == "balanced" and a_tpot > band_limit:
            a.verdict = (
                f"outside the latency band: TPOT {a_tpot * 1e3:.2f} ms > {1 + request.latency_band:.2f} × "
                f"best {best_tpot * 1e3:.2f} ms"
            )
            if a_cost < c_cost * (1 - tol):
                a.verdict += f", though {-cost_delta:.1f}% cheaper"
            elif a_cost <= c_cost * (1 + tol):
                a.verdict += f", at the same cost within {tol:.0%}"
            else:
                a.verdict += f", and {cost_delta:.1f}% dearer (${a_cost:.3f}/M output tokens)"
            continue
        if a in tied:
            a.verdict = (
                f"ties on cost (${a_cost:.3f} vs ${c_cost:.3f}, within {tol:.0%}); the tie goes to "
                f"{chosen.candidate.label} (smaller TP group / fewer GPUs)"
            )
        else:
            a.verdict = f"dearer: ${a_cost:.3f}/M output tokens vs ${c_cost:.3f} ({cost_delta:+.1f}%)"
        if request.objective == "balanced" and a_tpot < c_tpot:
            a.verdict += f"; {-tpot_delta:.1f}% faster, but the band allows {band_pct}"
    return chosen


def _closest_message(request: PlanRequest, assessments: list[Assessment]) -> tuple[str, Assessment | None]:
    model, topo = request.model, request.topology
    scope = (
        f"{model.name} at {'/'.join(request.dtypes)} on {topo.name} "
        f"({request.max_nodes} node(s) × {topo.gpus_per_node} GPUs × {_gib(topo.gpu_memory_bytes)}, "
        f"reserve {_gib(topo.reserve_bytes)}, KV cap {_gib(request.workload.kv_cap_bytes)})"
    )
    short = [a for a in assessments if a.shortfall_bytes is not None and a.candidate.gpus <= request.max_gpus]
    if not short:
        reasons = "; ".join(f"{a.candidate.label}: {a.rejected_reason}" for a in assessments[:5])
        return f"no shard plan fits {scope}: {reasons}", None
    closest = min(short, key=lambda a: (a.shortfall_bytes, _tie_key(a)))
    est = closest.estimate
    assert est is not None and closest.shortfall_bytes is not None
    msg = (
        f"no shard plan fits {scope}. Closest: {closest.candidate.label} "
        f"({closest.candidate.gpus} GPUs) needs {_gib(est.memory_needed_bytes)} per GPU "
        f"(weights {_gib(est.weight_bytes_per_gpu)} + reserve {_gib(topo.reserve_bytes)} + KV cap "
        f"{_gib(request.workload.kv_cap_bytes)}) but has {_gib(topo.gpu_memory_bytes)}: "
        f"short by {closest.shortfall_bytes:,} B ({_gib(closest.shortfall_bytes)}) per GPU."
    )
    hints: list[str] = []
    for nodes in range(request.max_nodes + 1, request.max_nodes + 8):
        wider = replace(request, max_nodes=nodes, tp=None, pp=None)
        fits = [a for a in (assess(wider, c) for c in enumerate_candidates(wider)) if a.feasible]
        if fits:
            best = choose(wider, fits)
            hints.append(f"--max-nodes {nodes} (the {request.objective} pick there: {best.candidate.label})")
            break
    for dtype in DTYPES:
        if dtype in request.dtypes:
            continue
        other = replace(request, dtypes=(dtype,), tp=None, pp=None)
        if any(assess(other, c).feasible for c in enumerate_candidates(other)):
            hints.append(f"--dtype {dtype}")
    if hints:
        msg += " It would fit with " + " or ".join(hints) + ", or a smaller --kv-cap-gb."
    return msg, closest


def search(request: PlanRequest) -> PlanResult:
    """Judge every candidate and choose one; raise :class:`NoFeasiblePlanError` if none fits, or
    :class:`LayoutError` if a fixed ``tp``/``pp`` cannot shard the model at all."""
    if request.tp is not None or request.pp is not None:
        # A fixed degree that cannot shard the model is a bad argument, not a hardware shortfall.
        check_layout(request.model, Candidate(request.tp or 1, request.pp or 1, request.dtypes[0]))
    cm = CostModel(request.model, request.topology, request.workload)
    candidates = enumerate_candidates(request)
    assessments = [assess(request, c, cm) for c in candidates]
    feasible = [a for a in assessments if a.feasible]
    if not feasible:
        message, closest = _closest_message(request, assessments)
        raise NoFeasiblePlanError(message, closest=closest, assessments=assessments)
    chosen = choose(request, feasible)
    return PlanResult(request=request, chosen=chosen, assessments=assessments)


def explain(request: PlanRequest) -> tuple[Assessment | None, list[Assessment]]:
    """Every candidate judged, in :func:`explanation_order`, with the objective's choice, or None
    when nothing fits. Unlike :func:`search` this never raises for an infeasible request: the
    rejections, each with its reason and shortfall, are the explanation."""
    try:
        result = search(request)
    except NoFeasiblePlanError as exc:
        return None, explanation_order(exc.assessments, request.objective)
    return result.chosen, explanation_order(result.assessments, request.objective)


def explanation_order(assessments: list[Assessment], objective: str) -> list[Assessment]:
    """The chosen plan, then the feasible ones by the objective's metric (TPOT for latency, $/M
    tokens otherwise), then the rejected ones, closest to fitting first."""

    def key(a: Assessment) -> tuple[int, float]:
        if a.chosen:
            return (0, 0.0)
        if a.feasible:
            assert a.estimate is not None
            if objective == "latency":
                return (1, a.estimate.tpot_batch1_s)
            return (1, a.estimate.usd_per_million_tokens or 0.0)
        return (2, float(a.shortfall_bytes) if a.shortfall_bytes is not None else math.inf)

    return sorted(assessments, key=key)


__all__ = [
    "OBJECTIVES",
    "Assessment",
    "NoFeasiblePlanError",
    "PlanRequest",
    "PlanResult",
    "PlannerError",
    "assess",
    "choose",
    "enumerate_candidates",
    "explain",
    "explanation_order",
    "search",
]
