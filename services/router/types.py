"""The router's domain vocabulary: requests and stream events (sampling settings and finish
reasons are the worker's too: ``services.common.sampling``).

Plain dataclasses, no gRPC and no protobuf: ``server.py`` converts RouterGenerateRequest into a
:class:`GenerationRequest` and the events below back into RouterGenerateResponse; the OpenAI
HTTP front door builds the same request from JSON.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from services.common.sampling import FinishReason, SamplingParams


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
    sampling: SamplingParams = field(default_factory=SamplingParams)
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


@dataclass(frozen=True)
class Scored:
    """A prompt's logprobs from one group: ``logprobs[i]`` is token ``i+1``'s given the ones
    before; ``top_logprobs[i]`` the alternatives there; ``token_texts[i]`` token ``i`` alone."""

    request_id: str
    replica_group_id: str
    token_ids: list[int]
    token_texts: list[str]
    logprobs: list[float]
    top_logprobs: list[tuple[TokenAlternative, ...]]
    nll: float
    perplexity: float
