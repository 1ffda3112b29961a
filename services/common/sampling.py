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

GUIDE_KINDS = ("json_schema", "regex", "choice")  # services.common.guided compiles them

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
MAX_LOGIT_BIAS = 100.0  # OpenAI's range for a logit_bias value: [-100, 100]
MAX_LOGIT_BIAS_TOKENS = 1024  # entries one request's logit_bias may hold
MAX_PENALTY = 2.0  # OpenAI's range for presence_penalty and frequency_penalty: [-2, 2]


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
    continuation's: the seeded random stream resumes at that step, not at 0). ``min_p`` (vLLM's)
    drops tokens less likely than ``min_p`` times the most likely one, after temperature, 0 off;
    ``logit_bias`` (OpenAI's) is ``((token_id, bias), ...)`` added to those logits before any
    choice, greedy included (logprobs stay the model's own); ``min_tokens`` (vLLM's) keeps EOS and
    the stop_token_ids from being sampled until that many tokens exist, counting the ones before
    ``first_step`` (a continuation keeps the rule). ``presence_penalty`` and
    ``frequency_penalty`` (OpenAI's, in [-2, 2]) subtract from a token's logit once if it was
    generated and once per time it was; ``repetition_penalty`` (vLLM's, > 0, 1 off) divides a
    positive logit (multiplies a negative one) of every token in the prompt or the output. Generated
    tokens are counted across a continuation: its prompt's last ``first_step`` ids. ``guide``:
    structured outputs, ``(kind, spec)`` (``services.common.guided``). ``cache_salt``
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
    min_p: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    guide: tuple[str, str] | None = None

    def __post_init__(self) -> None:
        # accept lists and mappings for the tuple fields, keep the dataclass hashable
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        object.__setattr__(self, "stop", tuple(self.stop))
        bias = self.logit_bias.items() if isinstance(self.logit_bias, dict) else self.logit_bias
        object.__setattr__(self, "logit_bias", tuple(sorted((t, b) for t, b in bias)))
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
        m = self.min_p
        if isinstance(m, bool) or not isinstance(m, int | float) or not 0 <= m <= 1:
            raise InvalidRequest(f"min_p must be in [0, 1] (0 = off), got {m!r}")
        if len(self.logit_bias) > MAX_LOGIT_BIAS_TOKENS:
            raise InvalidRequest(f"logit_bias may hold at most {MAX_LOGIT_BIAS_TOKENS} tokens, "
                                 f"got {len(self.logit_bias)}")
        for tok, b in self.logit_bias:
            if not is_integer(tok) or not 0 <= tok <= MAX_UINT32:
                raise InvalidRequest(f"logit_bias keys must be token ids (integers >= 0), got {tok!r}")
            if isinstance(b, bool) or not isinstance(b, int | float) or not -MAX_LOGIT_BIAS <= b <= MAX_LOGIT_BIAS:
                raise InvalidRequest(f"logit_bias values must be numbers in [-100, 100], got {b!r} for token {tok}")
        if not is_integer(self.min_tokens) or self.min_tokens < 0:
            raise InvalidRequest(f"min_tokens must be an integer >= 0, got {self.min_tokens!r}")
        if self.min_tokens > self.first_step + self.max_tokens:
            raise InvalidRequest(f"min_tokens must be at most max_tokens ({self.max_tokens}), got {self.min_tokens}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int | float) or not -MAX_PENALTY <= v <= MAX_PENALTY:
                raise InvalidRequest(f"{name} must be a number in [-2, 2], got {v!r}")
        r = self.repetition_penalty
        if isinstance(r, bool) or not isinstance(r, int | float) or not math.isfinite(r) or not 0 < r <= 100:
            raise InvalidRequest(f"repetition_penalty must be a number in (0, 100] (1 = off), got {r!r}")
        if self.guide is not None:
            guide = tuple(self.guide)
            object.__setattr__(self, "guide", guide)
            if len(guide) != 2 or guide[0] not in GUIDE_KINDS or not isinstance(guide[1], str) or not guide[1]:
                raise InvalidRequest(f"guide must be (kind, spec) with kind one of {', '.join(GUIDE_KINDS)} and "
                                     f"a non-empty spec, got {str(guide)[:80]}")
        # every step index the request can reach fits the uint32 field, so a continuation's
        # first_step (this one + the tokens generated so far, fewer than max_tokens) is valid too
        if self.first_step + self.max_tokens > MAX_UINT32:
            raise InvalidRequest(f"first_step + max_tokens must be at most 2**32 - 1, got "
                                 f"{self.first_step} + {self.max_tokens} = {self.first_step + self.max_tokens}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0

    @property
    def has_penalties(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty) or self.repetition_penalty != 1
