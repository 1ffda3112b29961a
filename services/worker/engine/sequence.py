"""A request as the scheduler sees it: prompt, generated tokens, sampling parameters, state.

Pure Python. ``num_computed_tokens`` counts the leading tokens of ``all_token_ids`` whose keys
and values are in the KV cache. A sequence therefore needs
``num_tokens - num_computed_tokens`` more tokens run through the model before it can sample:
the whole prompt at first (a prefill, possibly chunked over several steps), then exactly one
(the last sampled token: a decode). After a preemption ``num_computed_tokens`` drops to 0 and
prompt + generated tokens are prefilled again (recompute).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from services.common.sampling import FinishReason, InvalidRequest, SamplingParams, is_integer


class SequenceStatus(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """One request's state. ``arrival`` is set by the scheduler (a monotonic counter)."""

    seq_id: int
    prompt_token_ids: list[int]
    sampling_params: SamplingParams = field(default_factory=SamplingParams)
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0
    arrival: int = -1
    finish_reason: FinishReason | None = None
    num_preemptions: int = 0
    # prefix caching: the names of the full blocks of all_token_ids (with sampling_params.cache_salt),
    # filled in by the scheduler
    block_hashes: list[bytes] = field(default_factory=list, repr=False)
    # the token ids that end it (its stop_token_ids, and EOS unless ignored), set by the scheduler
    stop_ids: frozenset[int] = field(default_factory=frozenset, repr=False)
    # structured outputs: the llguidance matcher of its guide, on the driver (engine/guided.py)
    matcher: Any = field(default=None, repr=False)

    def __post_init__(self) -> None:
        self.prompt_token_ids = list(self.prompt_token_ids)
        if not is_integer(self.seq_id):
            raise InvalidRequest(f"seq_id must be an integer, got {self.seq_id!r}")
        if not self.prompt_token_ids:
            raise InvalidRequest("prompt must not be empty, got 0 tokens")
        for tok in self.prompt_token_ids:
            if not is_integer(tok) or tok < 0:
                raise InvalidRequest(f"prompt token ids must be integers >= 0, got {tok!r}")

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_ids_slice(self, start: int, stop: int) -> list[int]:
        """``all_token_ids[start:stop]`` without building the whole list."""
        p = len(self.prompt_token_ids)
        if stop <= p:
            return self.prompt_token_ids[start:stop]
        if start >= p:
            return self.output_token_ids[start - p:stop - p]
        return self.prompt_token_ids[start:] + self.output_token_ids[:stop - p]

    @property
    def sampling_step(self) -> int:
        """The request's index of the token sampled next: the tokens it generated before its
        prompt's end (``first_step``, set on a continuation) plus those generated here. With a
        seed it picks the random stream, so a continued request draws as if it never moved."""
        return self.sampling_params.first_step + len(self.output_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def max_total_tokens(self) -> int:
        """The most tokens this sequence can ever hold: prompt + max_tokens."""
        return self.num_prompt_tokens + self.sampling_params.max_tokens
