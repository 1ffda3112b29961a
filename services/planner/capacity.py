"""Capacity: how many replica groups (and nodes) a demand needs, and the autoscaling block.

    demand tokens/s     = req_per_s · output_tokens
    tokens/s / replica  = c · r        c concurrent sequences per replica (the KV cap's ceiling,
                                         or fewer to meet a TPOT target), r tokens/s per sequence
                                         (1 / TPOT(c), or --seq-tokens-per-s)
    replicas            = ⌈demand tokens/s / tokens/s per replica⌉
    nodes               = ⌈replicas / replicas_per_node⌉  (or replicas · nodes_per_replica)

Worked example (Llama-3-70B, TP4/PP2, fp16, 20 GiB KV cap, 2,048 avg context, 40 tok/s/seq):
256 · 40 = 10,240 tok/s per replica; 400 req/s · 300 tokens = 120,000 tok/s → ⌈11.72⌉ = 12.

By Little's law the same number is ⌈sequences in flight / c⌉ with sequences in flight =
req_per_s · output_tokens / r, so sizing on tokens/s and sizing on KV occupancy agree.

Autoscaling scales on KV-cache utilization: out above 80 %, in below 35 %. The floor is a third
of the replicas the demand needs (off-peak traffic) and the ceiling twice (bursts), e.g.
4 and 24 around 12; ``replicas_below_scale_out`` is how many keep utilization under 80 % at the
stated demand, i.e. ⌈exact replicas / 0.80⌉.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from services.common.errors import InvalidArgument
from services.planner.cost_model import Candidate, CostEstimate, CostModel, Workload
from services.planner.specs import ModelSpec
from services.planner.topology import Topology


class CapacityError(InvalidArgument):
    """The demand cannot be met by this layout as asked (e.g. a TPOT target it can never reach)."""


@dataclass(frozen=True)
class Demand:
    """Arrival rate and output length, with an optional per-token latency target."""

    req_per_s: float
    output_tokens: int
    tpot_target_s: float | None = None

    def __post_init__(self) -> None:
        if not self.req_per_s > 0:
            raise CapacityError(f"req_per_s must be > 0, got {self.req_per_s!r}")
        if not isinstance(self.output_tokens, int) or self.output_tokens < 1:
            raise CapacityError(f"output_tokens must be a positive integer, got {self.output_tokens!r}")
        if self.tpot_target_s is not None and not self.tpot_target_s > 0:
            raise CapacityError(f"tpot_target_s must be > 0, got {self.tpot_target_s!r}")

    @property
    def output_tokens_per_s(self) -> float:
        return self.req_per_s * self.output_tokens


@dataclass(frozen=True)
class AutoscalingPolicy:
    """shard-plan.yaml's autoscaling block: scale on KV-cache utilization between two thresholds."""

    min_replicas: int
    max_replicas: int
    scale_on: str = "kv_cache_utilization_pct"
    scale_out_threshold: int = 80
    scale_in_threshold: int = 35

    def __post_init__(self) -> None:
        if self.min_replicas < 1 or self.max_replicas < self.min_replicas:
            raise CapacityError(
                f"need 1 ≤ min_replicas ≤ max_replicas, got min {self.min_replicas}, max {self.max_replicas}"
            )
        if not 0 < self.scale_in_threshold < self.scale_out_threshold <= 100:
            raise CapacityError(
                "need 0 < scale_in_threshold < scale_out_threshold ≤ 100, got "
                f"in {self.scale_in_threshold}, out {self.scale_out_threshold}"
            )

    @classmethod
    def for_replicas(cls, replicas: int, *, min_replicas: int | None = None,
                     max_replicas: int | None = None) -> AutoscalingPolicy:
        low = min_replicas if min_replicas is not None else max(1, math.ceil(replicas / 3))
        high = max_replicas if max_replicas is not None else max(low, 2 * replicas)
        return cls(min_replicas=low, max_replicas=high)


@dataclass(frozen=True)
class CapacityPlan:
    estimate: CostEstimate
    demand: Demand
    concurrency_per_replica: int
    tpot_s: float  # per-sequence time per token at that concurrency
    seq_tokens_per_s: float
    seq_rate_source: str  # "given" (--seq-tokens-per-s) or "predicted" (1 / TPOT)
    tokens_per_s_per_replica: float
    replicas_exact: float
    replicas: int
    replicas_below_scale_out: int
    nodes: int
    gpus: int
    autoscaling: AutoscalingPolicy

    @property
    def kv_utilization_at_demand(self) -> float:
        return self.replicas_exact / self.replicas


def _max_concurrency_for_target(cm: CostModel, candidate: Candidate, ceiling: int, target_s: float) -> int:
    """Largest c ≤ ceiling with TPOT(c) ≤ target (TPOT grows with c); 0 if even c = 1 misses."""
    if cm.tpot_s(candidate, 1) > target_s:
        return 0
    lo, hi = 1, ceiling
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if cm.tpot_s(candidate, mid) <= target_s:
            lo = mid
        else:
            hi = mid - 1
    return lo


def plan_capacity(
    model: ModelSpec,
    topology: Topology,
    candidate: Candidate,
    workload: Workload,
    demand: Demand,
    *,
    min_replicas: int | None = None,
    max_replicas: int | None = None,
) -> CapacityPlan:
    """Size a fleet of ``candidate`` replica groups for ``demand``."""
    cm = CostModel(model, topology, workload)
    est = cm.estimate(candidate)
    if not est.fits:
        raise CapacityError(
            f"{candidate.label} does not fit {model.name} on {topology.name}: short by "
            f"{est.shortfall_bytes:,} B per GPU"
        )
    ceiling = est.concurrency
    if ceiling < 1:
        raise CapacityError(
            f"{candidate.label}: the KV cap holds {est.kv_tokens_per_gpu:,} tokens per GPU, less than one "
            f"{workload.avg_context:,}-token sequence"
        )
    target = demand.tpot_target_s
    if workload.seq_tokens_per_s is not None:
        seq_rate = workload.seq_tokens_per_s
        tpot = 1.0 / seq_rate
        if target is not None and tpot > target:
            raise CapacityError(
                f"--seq-tokens-per-s {seq_rate:g} means a TPOT of {tpot * 1e3:.2f} ms, above the "
                f"target {target * 1e3:.2f} ms"
            )
        concurrency = ceiling
    else:
        concurrency = ceiling
        if target is not None:
            concurrency = _max_concurrency_for_target(cm, candidate, ceiling, target)
            if concurrency == 0:
                raise CapacityError(
                    f"{candidate.label}: predicted TPOT at batch 1 is {est.tpot_batch1_s * 1e3:.2f} ms, "
                    f"above the target {target * 1e3:.2f} ms; try a larger TP degree or a smaller dtype"
                )
        tpot = cm.tpot_s(candidate, concurrency)
        seq_rate = 1.0 / tpot
    per_replica = concurrency * seq_rate
    exact = demand.output_tokens_per_s / per_replica
    # Guard the ceiling against float noise: 120000/10240 must not become 12.000000001 → 13.
    replicas = max(1, math.ceil(round(exact, 9)))
    below_out = max(1, math.ceil(round(exact / 0.80, 9)))
    if est.replicas_per_node:
        nodes = math.ceil(replicas / est.replicas_per_node)
    else:
        nodes = replicas * est.nodes_per_replica
    return CapacityPlan(
        estimate=est,
        demand=demand,
        concurrency_per_replica=concurrency,
        tpot_s=tpot,
        seq_tokens_per_s=seq_rate,
        seq_rate_source="given" if workload.seq_tokens_per_s is not None else "predicted",
        tokens_per_s_per_replica=per_replica,
        replicas_exact=exact,
        replicas=replicas,
        replicas_below_scale_out=below_out,
        nodes=nodes,
        gpus=replicas * candidate.gpus,
        autoscaling=AutoscalingPolicy.for_replicas(replicas, min_replicas=min_replicas, max_replicas=max_replicas),
    )


__all__ = ["AutoscalingPolicy", "CapacityError", "CapacityPlan", "Demand", "plan_capacity"]
