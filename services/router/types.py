"""The router's domain vocabulary: sampling settings, requests, stream events, finish reasons.

Plain dataclasses, no gRPC and no protobuf: ``server.py`` converts RouterGenerateRequest into a
:class:`GenerationRequest` and the events below back into RouterGenerateResponse; the OpenAI
HTTP front door builds the same request from JSON.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from services.common.errors import InvalidArgument

MAX_LOGPROBS = 20  # the worker's cap on top alternatives per token (vLLM's default)
MAX_SEED = 2**64 - 1
DEFAULT_MAX_TOKENS = 16  # OpenAI's completions default, as common.proto documents


class FinishReason(Enum):
    """Why a stream ended: the proto's FinishReason, spelled as the worker's engine spells it."""

    LENGTH = "length"
    EOS_TOKEN = "eos_token"
    STOP_SEQUENCE = "stop_sequence"
    CANCELLED = "cancelled"
    ERROR = "error"

    @property
    def openai(self) -> str:
        """OpenAI's ``finish_reason``: EOS and stop strings are both "stop"."""
        return {FinishReason.LENGTH: "length", FinishReason.EOS_TOKEN: "stop",
                FinishReason.STOP_SEQUENCE: "stop"}.get(self, "abort")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class SamplingSpec:
    """Sampling and stopping settings of one request (common.proto's SamplingParameters with
    its documented defaults applied). :meth:`validate` raises InvalidArgument naming the field."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    max_tokens: int = DEFAULT_MAX_TOKENS
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    logprobs: int = 0
    ignore_eos: bool = False

    def validate(self) -> SamplingSpec:
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, int | float) or not math.isfinite(t) or t < 0:
            raise InvalidArgument(f"temperature must be a finite number >= 0, got {t!r}")
        p = self.top_p
        if isinstance(p, bool) or not isinstance(p, int | float) or not (0 < p <= 1):
            raise InvalidArgument(f"top_p must be in (0, 1], got {p!r}")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise InvalidArgument(f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}")
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed <= MAX_SEED):
            raise InvalidArgument(f"seed must be an integer in [0, 2**64 - 1], got {self.seed!r}")
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise InvalidArgument(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise InvalidArgument(f"stop strings must be non-empty strings, got {s!r}")
        for tok in self.stop_token_ids:
            if not _is_int(tok) or tok < 0:
                raise InvalidArgument(f"stop_token_ids must be integers >= 0, got {tok!r}")
        if not _is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise InvalidArgument(f"logprobs must be an integer in [0, {MAX_LOGPROBS}], got {self.logprobs!r}")
        return self


@dataclass(frozen=True)
class GenerationRequest:
    """One generation as the router receives it: a prompt as text or as token ids.

    ``add_special_tokens`` applies to text only: False for chat prompts, whose template already
    spells the BOS token (as ``transformers.apply_chat_template`` tokenizes them).
    ``trace_context`` is the caller's W3C trace context (``traceparent``, ``tracestate``,
    ``baggage`` as (key, value) pairs), passed on to the worker so its spans join the caller's trace.
    """

    model: str = ""
    prompt_text: str | None = None
    prompt_ids: tuple[int, ...] | None = None
    sampling: SamplingSpec = field(default_factory=SamplingSpec)
    request_id: str = ""
    add_special_tokens: bool = True
    trace_context: tuple[tuple[str, str], ...] = ()


TRACE_CONTEXT_KEYS = ("traceparent", "tracestate", "baggage")


def trace_context_of(pairs: Iterable[tuple[str, Any]] | None) -> tuple[tuple[str, str], ...]:
    """The W3C trace context among gRPC metadata or HTTP headers ((key, value) pairs, any case)."""
    return tuple((k.lower(), v) for k, v in pairs or () if isinstance(v, str) and k.lower() in TRACE_CONTEXT_KEYS)


# TokenAlternative and TokenOut are made once per relayed token: plain slotted dataclasses, as a
# frozen one pays an object.__setattr__ per field (several times the cost of the whole object)


@dataclass(slots=True)
class TokenAlternative:
    """One of the most likely tokens at a position."""

    token_id: int
    text: str
    logprob: float


@dataclass(slots=True)
class TokenOut:
    """A generated token as the router streams it; ``text`` never splits a character."""

    index: int
    token_id: int
    text: str
    logprob: float
    top_logprobs: tuple[TokenAlternative, ...] = ()
    token_text: str = ""  # the token on its own (for OpenAI logprobs); filled only when asked


@dataclass(frozen=True)
class Timings:
    """Nanoseconds, from the request's arrival at the router."""

    queue_ns: int = 0
    time_to_first_token_ns: int = 0
    decode_ns: int = 0
    total_ns: int = 0


@dataclass(frozen=True)
class Finished:
    """The last event of a stream."""

    reason: FinishReason
    prompt_tokens: int
    completion_tokens: int
    timings: Timings = field(default_factory=Timings)
    stop_sequence: str | None = None
    text: str = ""  # the whole completion text
