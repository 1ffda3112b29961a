"""A request as the scheduler sees it: prompt, generated tokens, sampling parameters, state.

Pure Python. ``num_computed_tokens`` counts the leading tokens of ``all_token_ids`` whose keys
and values are in the KV cache. A sequence therefore needs
``num_tokens - num_computed_tokens`` more tokens run through the model before it can sample:
the whole prompt at first (a prefill, possibly chunked over several steps), then exactly one
(the last sampled token: a decode). After a preemption ``num_computed_tokens`` drops to 0 and
prompt + generated tokens are prefilled again (recompute).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import Enum

from services.common.errors import InvalidArgument

MAX_LOGPROBS = 20  # top-k alternatives a request may ask for (vLLM's default cap)
MAX_SEED = 2**64 - 1  # the proto's uint64


class InvalidRequest(InvalidArgument):
    """A request's field is out of range; the message names the field, the rule and the value.
    Maps to gRPC INVALID_ARGUMENT / HTTP 400."""


class SequenceStatus(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(Enum):
    """Why generation stopped; the same cases as the proto's ``FinishReason``."""

    LENGTH = "length"  # max_tokens or max_model_len reached
    EOS_TOKEN = "eos_token"  # an EOS token or one of the request's stop_token_ids
    STOP_SEQUENCE = "stop_sequence"  # a stop string matched (detected by the caller)
    CANCELLED = "cancelled"  # client cancel / abort
    ERROR = "error"


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token and when to stop (defaults as the proto documents them).

    ``temperature`` 0 is greedy; ``top_k`` 0 disables top-k; ``top_p`` 1 disables nucleus
    sampling; ``seed`` None draws from the sampler's own generator (not reproducible);
    ``logprobs`` is how many top alternatives to return per token (0 = only the sampled one's).
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    max_tokens: int = 16
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    logprobs: int = 0
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        # accept lists for the tuple fields, keep the dataclass hashable
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        object.__setattr__(self, "stop", tuple(self.stop))
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, int | float) or not math.isfinite(t) or t < 0:
            raise InvalidRequest(f"temperature must be a finite number >= 0, got {t!r}")
        p = self.top_p
        if isinstance(p, bool) or not isinstance(p, int | float) or not (0 < p <= 1):
            raise InvalidRequest(f"top_p must be in (0, 1], got {p!r}")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise InvalidRequest(f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}")
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed <= MAX_SEED):
            raise InvalidRequest(f"seed must be an integer in [0, 2**64 - 1], got {self.seed!r}")
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise InvalidRequest(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        for tok in self.stop_token_ids:
            if not _is_int(tok) or tok < 0:
                raise InvalidRequest(f"stop_token_ids must be integers >= 0, got {tok!r}")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise InvalidRequest(f"stop strings must be non-empty strings, got {s!r}")
        if not _is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise InvalidRequest(f"logprobs must be an integer in [0, {MAX_LOGPROBS}], got {self.logprobs!r}")
        if not isinstance(self.ignore_eos, bool):
            raise InvalidRequest(f"ignore_eos must be a bool, got {self.ignore_eos!r}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0


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

    def __post_init__(self) -> None:
        self.prompt_token_ids = list(self.prompt_token_ids)
        if not _is_int(self.seq_id):
            raise InvalidRequest(f"seq_id must be an integer, got {self.seq_id!r}")
        if not self.prompt_token_ids:
            raise InvalidRequest("prompt must not be empty, got 0 tokens")
        for tok in self.prompt_token_ids:
            if not _is_int(tok) or tok < 0:
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
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def max_total_tokens(self) -> int:
        """The most tokens this sequence can ever hold: prompt + max_tokens."""
        return self.num_prompt_tokens + self.sampling_params.max_tokens
