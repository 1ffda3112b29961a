"""How far a candidate plan's numbers are from a reference plan's on the same tokens.

Both plans score the same chunks of token ids (teacher forcing: position ``i`` predicts token
``i+1``). Per position each gives the log-probability of the actual next token and its own top-1
(argmax) token. Over all positions of all chunks:

- perplexity of each plan, ``exp(-mean logprob)``, and the candidate's delta in percent,
  ``100 * (ppl_candidate / ppl_reference - 1)``;
- ``|Δ logprob|`` per position: its mean, p99 and max;
- top-1 agreement: the share of positions where both plans' argmax is the same token, the
  token-level divergence a perplexity average can hide.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Protocol


class ChunkScores(Protocol):
    logprobs: Sequence[float]  # log p(next token) at each position
    argmax: Sequence[int]  # the plan's top-1 token at each position


@dataclass
class ScoreResult:
    """One chunk's scores from one plan (a :class:`ChunkScores`), with its perplexity."""

    n_tokens: int
    logprobs: list[float]
    nll: float
    perplexity: float
    argmax: list[int] = field(default_factory=list)  # the model's top-1 token at each position
    # the most likely (token id, logprob) at each position, best first, when asked for
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)

    @classmethod
    def from_logprobs(cls, n_tokens: int, logprobs: list[float], argmax: list[int] | None = None,
                      top_logprobs: list[list[tuple[int, float]]] | None = None) -> ScoreResult:
        nll = -sum(logprobs) / len(logprobs) if logprobs else 0.0
        return cls(n_tokens=n_tokens, logprobs=logprobs, nll=nll, perplexity=math.exp(nll), argmax=argmax or [],
                   top_logprobs=top_logprobs or [])

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class Comparison:
    chunks: int
    scored_tokens: int
    reference_perplexity: float
    candidate_perplexity: float
    perplexity_delta_pct: float
    mean_abs_logprob_delta: float
    p99_abs_logprob_delta: float
    max_abs_logprob_delta: float
    top1_agreement: float

    def to_dict(self) -> dict[str, float | int]:
        return asdict(self)


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100) by linear interpolation between closest ranks."""
    if not values:
        raise ValueError("percentile of no values")
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100.0
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def perplexity_delta_pct(reference_logprob_sum: float, candidate_logprob_sum: float, positions: int) -> float:
    """``100 * (ppl_candidate / ppl_reference - 1)`` from the two plans' sums of log p(next token)
    over the same ``positions``: ``exp(-Σc/n) / exp(-Σr/n) = exp((Σr - Σc) / n)``."""
    if positions <= 0:
        raise ValueError(f"need positions > 0, got {positions}")
    return 100.0 * (math.exp((reference_logprob_sum - candidate_logprob_sum) / positions) - 1.0)


def compare(reference: Sequence[ChunkScores], candidate: Sequence[ChunkScores]) -> Comparison:
    """The figures above; the two must have scored the same chunks (same counts everywhere)."""
    if len(reference) != len(candidate) or not reference:
        raise ValueError(f"need the same non-zero number of chunks, got {len(reference)} and {len(candidate)}")
    ref_sum = cand_sum = 0.0
    deltas: list[float] = []
    agree = 0
    for i, (r, c) in enumerate(zip(reference, candidate)):
        if len(r.logprobs) != len(c.logprobs) or len(r.argmax) != len(r.logprobs) or len(c.argmax) != len(c.logprobs):
            raise ValueError(f"chunk {i}: {len(r.logprobs)} reference and {len(c.logprobs)} candidate positions")
        ref_sum += sum(r.logprobs)
        cand_sum += sum(c.logprobs)
        deltas.extend(abs(a - b) for a, b in zip(r.logprobs, c.logprobs))
        agree += sum(a == b for a, b in zip(r.argmax, c.argmax))
    n = len(deltas)
    if n == 0:
        raise ValueError("no scored positions")
    ref_ppl, cand_ppl = math.exp(-ref_sum / n), math.exp(-cand_sum / n)
    return Comparison(chunks=len(reference), scored_tokens=n, reference_perplexity=ref_ppl,
                      candidate_perplexity=cand_ppl, perplexity_delta_pct=perplexity_delta_pct(ref_sum, cand_sum, n),
                      mean_abs_logprob_delta=sum(deltas) / n, p99_abs_logprob_delta=percentile(deltas, 99.0),
                      max_abs_logprob_delta=max(deltas), top1_agreement=agree / n)


def bootstrap_delta_interval(reference: Sequence[ChunkScores], candidate: Sequence[ChunkScores], *,
                             samples: int = 1000, confidence: float = 0.95, seed: int = 0) -> tuple[float, float]:
    """A ``confidence`` interval of the perplexity delta (%) by the percentile bootstrap over
    chunks: ``samples`` times, draw as many chunks as there are, with replacement, and take the
    delta of the draw; the interval is the draws' central ``confidence`` share. Seeded, so the
    same scores give the same interval."""
    if not 0 < confidence < 1 or samples < 1:
        raise ValueError(f"need 0 < confidence < 1 and samples >= 1, got {confidence} and {samples}")
    sums = [(sum(r.logprobs), sum(c.logprobs), len(r.logprobs)) for r, c in zip(reference, candidate, strict=True)]
    rng = random.Random(seed)
    deltas = []
    for _ in range(samples):
        draw = [sums[rng.randrange(len(sums))] for _ in sums]
        deltas.append(perplexity_delta_pct(sum(d[0] for d in draw), sum(d[1] for d in draw), sum(d[2] for d in draw)))
    tail = 100.0 * (1 - confidence) / 2
    return percentile(deltas, tail), percentile(deltas, 100.0 - tail)


@dataclass(frozen=True)
class GateVerdict:
    passed: bool
    reasons: tuple[str, ...]  # why it failed (empty when it passed)
    delta_interval_pct: tuple[float, float]
    threshold_pct: float
    min_top1_agreement: float | None
    exact: bool = False  # judged by equality of every logprob (two layout-invariant plans), not the figures


def gate(comparison: Comparison, interval: tuple[float, float], *, threshold_pct: float,
         min_top1_agreement: float | None) -> GateVerdict:
    """Pass only if the interval's upper end is within the threshold (the delta is small with
    confidence, not just on average) and, when a floor is set, top-1 agreement reaches it."""
    reasons = []
    if interval[1] > threshold_pct:
        reasons.append(f"perplexity delta {comparison.perplexity_delta_pct:+.3f} % (95 % interval "
                       f"{interval[0]:+.3f} .. {interval[1]:+.3f} %) exceeds {threshold_pct:g} %")
    if min_top1_agreement is not None and comparison.top1_agreement < min_top1_agreement:
        reasons.append(f"top-1 agreement {comparison.top1_agreement:.4f} is below {min_top1_agreement:g}")
    return GateVerdict(not reasons, tuple(reasons), interval, threshold_pct, min_top1_agreement)
