"""The comparison figures on hand-made scores whose answers are known."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

import pytest

from services.quality.comparison import bootstrap_delta_interval, compare, gate, percentile


@dataclass
class Scores:
    logprobs: list[float]
    argmax: list[int]


def test_identical_plans_differ_by_nothing() -> None:
    chunk = Scores([-1.0, -2.0, -0.5], [3, 4, 5])
    c = compare([chunk, chunk], [chunk, chunk])
    assert c.scored_tokens == 6 and c.chunks == 2
    assert c.perplexity_delta_pct == 0.0 and c.max_abs_logprob_delta == 0.0 and c.top1_agreement == 1.0
    assert c.reference_perplexity == pytest.approx(math.exp(3.5 / 3))


def test_figures_of_a_known_shift() -> None:
    reference = [Scores([-1.0] * 4, [1, 2, 3, 4])]
    candidate = [Scores([-1.1, -1.0, -1.0, -0.9], [1, 2, 9, 9])]
    c = compare(reference, candidate)
    assert c.perplexity_delta_pct == pytest.approx(0.0, abs=1e-9)  # the shifts cancel in the mean
    assert c.mean_abs_logprob_delta == pytest.approx(0.05)
    assert c.max_abs_logprob_delta == pytest.approx(0.1)
    assert c.top1_agreement == 0.5
    worse = compare(reference, [Scores([-1.1] * 4, [1, 2, 3, 4])])
    assert worse.perplexity_delta_pct == pytest.approx(100 * (math.exp(0.1) - 1))


def test_percentile_interpolates() -> None:
    assert percentile([0.0, 10.0], 50) == 5.0
    assert percentile(list(range(101)), 99) == 99.0
    assert percentile([7.0], 99) == 7.0


def test_mismatched_chunks_are_refused() -> None:
    with pytest.raises(ValueError, match="same non-zero number"):
        compare([Scores([-1.0], [1])], [])
    with pytest.raises(ValueError, match="chunk 0"):
        compare([Scores([-1.0], [1])], [Scores([-1.0, -2.0], [1, 2])])


def test_bootstrap_interval_brackets_the_delta_and_is_seeded() -> None:
    gen = random.Random(1)
    reference = [Scores([-2.0 + gen.uniform(-0.5, 0.5) for _ in range(50)], [0] * 50) for _ in range(20)]
    candidate = [Scores([lp - 0.01 + gen.uniform(-0.02, 0.02) for lp in r.logprobs], [0] * 50) for r in reference]
    c = compare(reference, candidate)
    low, high = bootstrap_delta_interval(reference, candidate)
    assert low < c.perplexity_delta_pct < high and 0 < low
    assert bootstrap_delta_interval(reference, candidate) == (low, high)
    assert gate(c, (low, high), threshold_pct=5.0, min_top1_agreement=0.97).passed
    failed = gate(c, (low, high), threshold_pct=low / 2, min_top1_agreement=None)
    assert not failed.passed and "exceeds" in failed.reasons[0]
    disagree = compare(reference, [Scores(s.logprobs, [1] * 50) for s in candidate])
    verdict = gate(disagree, (low, high), threshold_pct=5.0, min_top1_agreement=0.97)
    assert not verdict.passed and "top-1 agreement 0.0000" in verdict.reasons[0]
