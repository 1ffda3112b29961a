"""One round of the drift monitor at a time, on made-up scores: a failing group is alerted
(and remembered), a group that passes again is logged as cleared, a group that cannot be
scored is skipped, and nothing stops the next round."""

from __future__ import annotations

import logging

import pytest

from services.cli.drift import DriftMonitor, drift_alert
from services.common.errors import Unavailable
from services.common.group_status import GroupStatus
from services.quality.comparison import ScoreResult
from services.quality.gate import GateResult, PlanScores, run_gate
from services.quality.golden_set import GoldenSet
from services.telemetry.rules import AlertKind

GOLDEN = GoldenSet(chunks=tuple(tuple(range(i, i + 9)) for i in range(4)), text_fingerprint="f", chunk_tokens=9)


def scores(plan: str, shift: float) -> PlanScores:
    results = [ScoreResult.from_logprobs(9, [-2.0 - shift - 0.01 * k for k in range(8)], [1 + (shift > 0)] * 8)
               for _ in GOLDEN.chunks]
    return PlanScores(plan, "tiny", "float32", results, 0.1)


class FakeChecker:
    """What DriftMonitor asks of a DriftChecker, with each group's scores set by the test."""

    registry_url = None

    def __init__(self) -> None:
        self.reference = scores("dtype=float32", 0.0)
        self.shift: dict[str, float | None] = {}

    def check(self, group: str) -> GateResult:
        shift = self.shift[group]
        if shift is None:
            raise Unavailable(f"worker of {group}: UNAVAILABLE")
        return run_gate(self.reference, scores(f"group={group}", shift), GOLDEN, bootstrap_samples=50)


def test_failing_groups_alert_and_a_pass_clears(caplog: pytest.LogCaptureFixture) -> None:
    checker = FakeChecker()
    monitor = DriftMonitor(checker, telemetry=None, groups=["rg-a", "rg-b", "rg-c"], record_results=False)
    checker.shift.update({"rg-a": 0.0, "rg-b": 0.2, "rg-c": None})
    with caplog.at_level(logging.INFO, logger="shardline.drift"):
        assert monitor.round() == {"rg-a": True, "rg-b": False, "rg-c": None}
        assert monitor.failing == {"rg-b"}
        checker.shift["rg-b"] = 0.0
        assert monitor.round() == {"rg-a": True, "rg-b": True, "rg-c": None}
    assert monitor.failing == set()
    text = caplog.text
    assert "group rg-b drifted (no --telemetry: no alert raised)" in text
    assert "group rg-b passes again: drift cleared" in text and "rg-a passes again" not in text
    assert "group rg-c not checked: Unavailable: worker of rg-c: UNAVAILABLE" in text


def test_the_alert_names_the_group_and_carries_the_figures() -> None:
    checker = FakeChecker()
    result = run_gate(checker.reference, scores("group=rg-b", 0.2), GOLDEN, bootstrap_samples=50)
    alert = drift_alert(result, "rg-b")
    assert alert.kind is AlertKind.QUALITY_DRIFT and alert.replica_group_id == "rg-b"
    assert alert.new_status is GroupStatus.DEGRADED and alert.reference == "dtype=float32"
    assert alert.perplexity_delta_pct == pytest.approx(result.comparison.perplexity_delta_pct)
    assert alert.perplexity_delta_pct > 20  # exp(0.2) - 1
    assert alert.threshold_pct == 0.5 and alert.timestamp_ms > 0
    assert f"{alert.perplexity_delta_pct:+.3f} %" in alert.message and "threshold 0.5 %" in alert.message
    assert "top-1 agreement 0.0000" in alert.message
