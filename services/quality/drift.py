"""Per-group drift: a serving replica group's golden-set scores gated against a trusted local plan.

What ``shardline gate --group ID`` runs once and ``shardline drift`` runs on a schedule. The
reference plan (by default ``dtype=float32`` at TP1 x PP1 of the model directory the operator
names) is scored once and reused for every group and every period, so a check costs one Score
per chunk on the group's worker and nothing else. A group is scored through its registry
endpoint (``group=ID``), so one that moved to a new endpoint is still found.

The reference's weights come from the operator's model directory, never from the group: a group
whose own copy of the weights went stale is then measured against the trusted copy. Workers do
not report their model directory, which is why the directory is asked for.

A group's recorded verdicts carry ``candidate = "group=<name>"`` (its registry name, else its
UUID), so its history is one query whichever id the operator typed.
"""

from __future__ import annotations

from dataclasses import dataclass

from services.common.errors import InvalidArgument
from services.common.registry import IN_ROTATION, QualityGateResult, ReplicaGroup, ShardRegistry, registry_group_id
from services.common.registry import NotFound as RegistryNotFound
from services.quality.gate import (
    DEFAULT_COLLECTIVE_TIMEOUT_S,
    DEFAULT_THRESHOLD_PCT,
    GateResult,
    PlanScores,
    check_comparable,
    golden_set_for,
    plan_spec,
    run_gate,
    score_live_group,
    score_plan,
)
from services.quality.golden_set import DEFAULT_CHUNK_TOKENS, GoldenSet

DEFAULT_REFERENCE = "dtype=float32"
DEFAULT_DRIFT_CHUNKS = 8  # a scheduled check is a handful of prefills per group, not a load test
# statuses of a group that takes requests; a degraded one is still checked, so it can pass again
CHECKED_STATUSES = IN_ROTATION


def _label(row: ReplicaGroup) -> str:
    # a worker's group id is the UUID of its name; a row made with another UUID is known by that
    if row.name and registry_group_id(row.name) == row.replica_group_id:
        return row.name
    return str(row.replica_group_id)


def group_label(group: str, registry_url: str | None) -> str:
    """The name a group's drift verdicts are recorded under: its registry name, else its UUID."""
    with ShardRegistry(registry_url) as registry:
        try:
            row = registry.get_group(registry_group_id(group))
        except RegistryNotFound:
            raise InvalidArgument(f"group={group}: no such replica group in the registry") from None
    return _label(row)


def serving_groups(registry_url: str | None) -> list[str]:
    """Every group of the registry that takes requests and has an endpoint, oldest first."""
    with ShardRegistry(registry_url) as registry:
        rows = registry.list_groups(status=CHECKED_STATUSES)
    return [_label(row) for row in rows if row.endpoint]


def drift_history(group: str, registry_url: str | None) -> list[QualityGateResult]:
    """The group's recorded verdicts, oldest first."""
    with ShardRegistry(registry_url, migrate_schema=True) as registry:
        return list(reversed(registry.list_gate_results(candidate=f"group={group}")))


@dataclass
class DriftChecker:
    """Scores the reference once, then gates any serving group against it."""

    model_dir: str
    reference_plan: str = DEFAULT_REFERENCE
    registry_url: str | None = None
    chunks: int = DEFAULT_DRIFT_CHUNKS
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS
    threshold_pct: float = DEFAULT_THRESHOLD_PCT
    min_top1_agreement: float | None = None
    bootstrap_samples: int = 1000
    collective_timeout_s: float = DEFAULT_COLLECTIVE_TIMEOUT_S
    score_timeout_s: float = 600.0

    def __post_init__(self) -> None:
        if not self.model_dir:
            raise InvalidArgument("the drift check needs --model DIR: the trusted weights and tokenizer its "
                                  "reference plan runs on (workers do not report their model directory)")
        self._spec = plan_spec(self.model_dir, self.reference_plan, collective_timeout_s=self.collective_timeout_s)
        self.golden: GoldenSet = golden_set_for(self.model_dir, self._spec, chunks=self.chunks,
                                                chunk_tokens=self.chunk_tokens)
        check_comparable([self._spec], self.golden)
        self._reference: PlanScores | None = None

    @property
    def reference(self) -> PlanScores:
        """The reference plan's scores, run the first time they are asked for."""
        if self._reference is None:
            self._reference = score_plan(self._spec, self.reference_plan, self.golden)
        return self._reference

    def check(self, group: str) -> GateResult:
        """Gate serving group ``group`` (a name or UUID) against the reference. Raises
        :class:`InvalidArgument` for a group the registry lacks or cannot score, and
        :class:`~services.common.errors.Unavailable` when its worker does not answer."""
        live = score_live_group(f"group={group}", self.golden, registry_url=self.registry_url,
                                timeout_s=self.score_timeout_s)
        return run_gate(self.reference, live, self.golden, threshold_pct=self.threshold_pct,
                        min_top1_agreement=self.min_top1_agreement, bootstrap_samples=self.bootstrap_samples)
