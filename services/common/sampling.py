"""The request vocabulary the router and the worker share: sampling settings with their one
validator and limits, and why a generation finished.

A request the router accepts is one the worker accepts: both build :class:`SamplingParams`,
whose ``__post_init__`` is the only place the rules live.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from enum import Enum

from services.common.errors import InvalidArgument

MAX_LOGPROBS = 20  # top alternatives a request may ask for per token (vLLM's default cap)
# What the proto's fields can carry: a value is valid only if its wire type holds it, so a
# request the router accepts reaches the worker unchanged.
MAX_SEED = 2**64 - 1  # uint64 seed
MAX_UINT32 = 2**32 - 1  # top_k, stop_token_ids, token ids, first_step
MAX_CACHE_SALT_CHARS = 1024
MAX_INT32 = 2**31 - 1  # max_tokens
DEFAULT_MAX_TOKENS = 16  # OpenAI's completions default, as common.proto documents
DEFAULT_TEMPERATURE = 1.0
DEFAULT_TOP_P = 1.0


class InvalidRequest(InvalidArgument):
    """A request's field is out of range; the message names the field, the rule and the value.
    Maps to gRPC INVALID_ARGUMENT / HTTP 400."""


class FinishReason(Enum):
    """Why generation stopped; the same cases as the proto's ``FinishReason``."""

    LENGTH = "length"  # max_tokens or max_model_len reached
    EOS_TOKEN = "eos_token"  # an EOS token or one of the request's stop_token_ids
    STOP_SEQUENCE = "stop_sequence"  # a stop string matched
    CANCELLED = "cancelled"  # client cancel / abort
    ERROR = "error"

    @property
    def openai(self) -> str:
        """OpenAI's ``finish_reason``: EOS and stop strings are both "stop"."""
        return _OPENAI_FINISH.get(self, "abort")


_OPENAI_FINISH = {FinishReason.LENGTH: "length", FinishReason.EOS_TOKEN: "stop", FinishReason.STOP_SEQUENCE: "stop"}


def as_float32(value: float) -> float:
    """``value`` as the proto's 32-bit float field carries it (inf past float32's range)."""
    try:
        return struct.unpack("f", struct.pack("f", value))[0]
    except OverflowError:  # finite but beyond float32: the wire would carry an infinity
        return math.copysign(math.inf, value)


def is_integer(value: object) -> bool:
    """An int that is not a bool (JSON's true is no token id)."""
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token and when to stop (defaults as the proto documents them).

    ``temperature`` 0 is greedy; ``top_k`` 0 disables top-k; ``top_p`` 1 disables nucleus
    sampling; ``seed`` None draws from the sampler's own generator (not reproducible);
    ``logprobs`` is how many top alternatives to return per token (0 = only the sampled one's);
    ``first_step`` is how many tokens the request generated before its prompt's end (a
    continuation's: the seeded random stream resumes at that step, not at 0). ``cache_salt``
    (not a sampling parameter, but it travels with them): the request shares cached prefix
    blocks only with requests of the same salt; None shares with every unsalted request.
    Construction validates every field and raises :class:`InvalidRequest` naming it.
    """

    temperature: float = DEFAULT_TEMPERATURE
    top_p: float = DEFAULT_TOP_P
    top_k: int = 0
    seed: int | None = None
    max_tokens: int = DEFAULT_MAX_TOKENS
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    logprobs: int = 0
    ignore_eos: bool = False
    first_step: int = 0
    cache_salt: str | None = None

    def __post_init__(self) -> None:
        # accept lists for the tuple fields, keep the dataclass hashable
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        object.__setattr__(self, "stop", tuple(self.stop))
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, int | float) or not math.isfinite(t) or t < 0:
            raise InvalidRequest(f"temperature must be a finite number >= 0, got {t!r}")
        if not math.isfinite(as_float32(t)):
            raise InvalidRequest(f"temperature must fit a 32-bit float (at most ~3.4e38), got {t!r}")
        p = self.top_p
        if isinstance(p, bool) or not isinstance(p, int | float) or not (0 < p <= 1):
            raise InvalidRequest(f"top_p must be in (0, 1], got {p!r}")
        if as_float32(p) == 0:
            raise InvalidRequest(f"top_p must be in (0, 1] as a 32-bit float (at least ~1.4e-45), got {p!r}")
        if not is_integer(self.top_k) or self.top_k < 0:
            raise InvalidRequest(f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}")
        if self.top_k > MAX_UINT32:
            raise InvalidRequest(f"top_k must be at most 2**32 - 1, got {self.top_k}")
        if self.seed is not None and (not is_integer(self.seed) or not 0 <= self.seed <= MAX_SEED):
            raise InvalidRequest(f"seed must be an integer in [0, 2**64 - 1], got {self.seed!r}")
        if not is_integer(self.max_tokens) or self.max_tokens < 1:
            raise InvalidRequest(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if self.max_tokens > MAX_INT32:
            raise InvalidRequest(f"max_tokens must be at most 2**31 - 1, got {self.max_tokens}")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise InvalidRequest(f"stop strings must be non-empty strings, got {s!r}")
        for tok in self.stop_token_ids:
            if not is_integer(tok) or tok < 0:
                raise InvalidRequest(f"stop_token_ids must be integers >= 0, got {tok!r}")
            if tok > MAX_UINT32:
                raise InvalidRequest(f"stop_token_ids must be at most 2**32 - 1, got {tok}")
        if not is_integer(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise InvalidRequest(f"logprobs must be an integer in [0, {MAX_LOGPROBS}], got {self.logprobs!r}")
        if not isinstance(self.ignore_eos, bool):
            raise InvalidRequest(f"ignore_eos must be a bool, got {self.ignore_eos!r}")
        if not is_integer(self.first_step) or self.first_step < 0:
            raise InvalidRequest(f"first_step must be an integer >= 0, got {self.first_step!r}")
        if self.first_step > MAX_UINT32:
            raise InvalidRequest(f"first_step must be at most 2**32 - 1, got {self.first_step}")
        salt = self.cache_salt
        if salt is not None and (not isinstance(salt, str) or not 0 < len(salt) <= MAX_CACHE_SALT_CHARS):
            raise InvalidRequest(f"cache_salt must be a non-empty string of at most {MAX_CACHE_SALT_CHARS} "
                                 f"characters, got {salt if not isinstance(salt, str) else salt[:40]!r}")
        # every step index the request can reach fits the uint32 field, so a continuation's
        # first_step (this one + the tokens generated so far, fewer than max_tokens) is valid too
        if self.first_step + self.max_tokens > MAX_UINT32:
            raise InvalidRequest(f"first_step + max_tokens must be at most 2**32 - 1, got "
                                 f"{self.first_step} + {self.max_tokens} = {self.first_step + self.max_tokens}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0
