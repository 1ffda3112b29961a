"""The registry's quality_gate_results: every verdict of the golden-set gate, kept with its figures."""

from __future__ import annotations

import pytest

from services.common.registry import InvalidValue, ShardRegistry


def test_gate_results_are_recorded_and_listed_newest_first(db_url: str) -> None:
    registry = ShardRegistry(db_url, migrate_schema=True)
    figures = dict(model_name="tiny", reference="dtype=float32", candidate="tp=2,dtype=int8", candidate_dtype="int8",
                   text_fingerprint="8347fe7bc7f42226", chunks=32, scored_tokens=16352, reference_perplexity=10.0,
                   candidate_perplexity=10.03, perplexity_delta_pct=0.3, delta_low_pct=0.2, delta_high_pct=0.4,
                   mean_abs_logprob_delta=0.01, p99_abs_logprob_delta=0.05, top1_agreement=0.98, threshold_pct=0.5,
                   min_top1_agreement=None, passed=True, reasons="")
    try:
        first = registry.record_gate_result(**figures)
        second = registry.record_gate_result(**{**figures, "passed": False, "threshold_pct": 0.1,
                                                "reasons": "perplexity delta exceeds 0.1 %"})
        assert [r.gate_id for r in registry.list_gate_results("tiny", "tp=2,dtype=int8")] == \
            [second.gate_id, first.gate_id]
        assert registry.list_gate_results(candidate="other") == []
        stored = registry.list_gate_results()[-1]
        assert stored.passed is True and stored.delta_high_pct == 0.4 and stored.min_top1_agreement is None
        with pytest.raises(InvalidValue, match="missing"):
            registry.record_gate_result(model_name="tiny")
    finally:
        registry.close()
