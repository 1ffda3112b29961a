"""A shadow pair's rolling window (the router's ``shadow.py``): the newest mirrored positions of one
(incumbent, candidate) pair and the figures they give, kept as running sums."""

from __future__ import annotations

import collections
import math
from collections.abc import Sequence
from dataclasses import dataclass

from services.quality.comparison import perplexity_delta_pct


@dataclass(frozen=True)
class WindowFigures:
    """A pair's rolling window; ``top1_agreement`` over ``greedy_tokens`` (NaN when none)."""

    tokens: int
    greedy_tokens: int
    incumbent_perplexity: float
    candidate_perplexity: float
    perplexity_delta_pct: float
    mean_abs_logprob_delta: float
    top1_agreement: float


class ShadowWindow:
    """The newest ``capacity`` mirrored positions of one (incumbent, candidate) pair: per position
    the incumbent's logprob, the candidate's, and (greedy requests) whether the candidate's argmax
    is the incumbent's token. Not thread-safe: the mirror's thread owns it.

    The sums behind the figures are kept as positions come and go, so a request costs its own
    positions, not the window's (the mirror's thread shares the router's GIL); every ``capacity``
    positions they are summed afresh, so that rounding cannot build up."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._positions: collections.deque[tuple[float, float, bool | None]] = collections.deque()
        self._incumbent_sum = self._candidate_sum = self._abs_sum = 0.0
        self._greedy = self._agree = 0
        self._since_resum = 0

    def __len__(self) -> int:
        return len(self._positions)

    def add(self, incumbent_logprobs: Sequence[float], candidate_logprobs: Sequence[float],
            agreement: Sequence[bool] | None = None) -> None:
        """Positions of one request; ``agreement`` per position for a greedy request, else None."""
        if len(incumbent_logprobs) != len(candidate_logprobs):
            raise ValueError(f"{len(incumbent_logprobs)} incumbent and {len(candidate_logprobs)} candidate positions")
        if agreement is not None and len(agreement) != len(incumbent_logprobs):
            raise ValueError(f"{len(agreement)} agreement flags for {len(incumbent_logprobs)} positions")
        flags = agreement if agreement is not None else [None] * len(incumbent_logprobs)
        positions = self._positions
        for position in zip(incumbent_logprobs, candidate_logprobs, flags):
            self._account(position, 1)
            positions.append(position)
            if len(positions) > self.capacity:
                self._account(positions.popleft(), -1)
        self._since_resum += len(incumbent_logprobs)
        if self._since_resum >= self.capacity:
            self._resum()

    def _account(self, position: tuple[float, float, bool | None], sign: int) -> None:
        inc, cand, same = position
        self._incumbent_sum += sign * inc
        self._candidate_sum += sign * cand
        self._abs_sum += sign * abs(inc - cand)
        if same is not None:
            self._greedy += sign
            self._agree += sign * same

    def _resum(self) -> None:
        self._incumbent_sum = self._candidate_sum = self._abs_sum = 0.0
        self._greedy = self._agree = self._since_resum = 0
        for position in self._positions:
            self._account(position, 1)

    def figures(self) -> WindowFigures | None:
        """The window's figures; None while it is empty."""
        n = len(self._positions)
        if not n:
            return None
        inc_sum, cand_sum, greedy = self._incumbent_sum, self._candidate_sum, self._greedy
        return WindowFigures(tokens=n, greedy_tokens=greedy, incumbent_perplexity=_perplexity(inc_sum, n),
                             candidate_perplexity=_perplexity(cand_sum, n),
                             perplexity_delta_pct=perplexity_delta_pct(inc_sum, cand_sum, n),
                             mean_abs_logprob_delta=max(0.0, self._abs_sum) / n,
                             top1_agreement=self._agree / greedy if greedy else math.nan)


def _perplexity(logprob_sum: float, n: int) -> float:
    try:
        return math.exp(-logprob_sum / n)
    except OverflowError:
        return math.inf
