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
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Protocol


class ChunkScores(Protocol):
    logprobs: Sequence[float]  # log p(next token) at each position
    argmax: Sequence[int]  # the plan's top-1 token at each position


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
                      candidate_perplexity=cand_ppl, perplexity_delta_pct=100.0 * (cand_ppl / ref_ppl - 1.0),
                      mean_abs_logprob_delta=sum(deltas) / n, p99_abs_logprob_delta=percentile(deltas, 99.0),
                      max_abs_logprob_delta=max(deltas), top1_agreement=agree / n)
