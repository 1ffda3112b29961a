"""StepPlan: what the driver tells every rank to run in one forward step (a micro-batch).

It crosses the control group pickled, so it holds plain Python lists only. Sequences appear in
the order their tokens are concatenated; ``sample`` marks the sequences whose last token in this
step gets a new token sampled (a decode, or the chunk that completes a prefill).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Self

from services.common.sampling import SamplingParams


@dataclass(frozen=True, kw_only=True)
class RowSampling:
    """How one row's next token is chosen: the sampler's input (``sampler.py`` says what each
    field does). Every SeqStep carries its own, so that the last stage samples statelessly."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    # the request's tokens generated so far, those before its prompt's end (first_step)
    # included: with ``seed`` it fixes the random stream (Sequence.sampling_step)
    num_generated: int = 0
    top_logprobs: int = 0
    min_p: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    # tokens this step must not sample (EOS and the stop ids while the request is under min_tokens)
    banned: tuple[int, ...] = ()
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    # with penalties only: the request's generated tokens (a continuation's included) and the rest
    # of its prompt (repetition_penalty counts both)
    generated: tuple[int, ...] = ()
    prompt: tuple[int, ...] = ()
    # structured outputs: one bit per token id, set for the tokens the guide allows next (LSB first;
    # empty: no guide)
    allowed: bytes = b""

    @classmethod
    def of(cls, params: SamplingParams, num_generated: int, *, banned: tuple[int, ...] = (),
           generated: tuple[int, ...] = (), prompt: tuple[int, ...] = (), allowed: bytes = b"", **more: Any) -> Self:
        """From a request's parameters; ``num_generated``: tokens the sequence generated after its
        prompt (the request's ``first_step`` is added). ``more``: a SeqStep's own fields."""
        return cls(temperature=params.temperature, top_p=params.top_p, top_k=params.top_k, seed=params.seed,
                   num_generated=params.first_step + num_generated, top_logprobs=params.logprobs,
                   min_p=params.min_p, logit_bias=params.logit_bias, banned=banned,
                   presence_penalty=params.presence_penalty, frequency_penalty=params.frequency_penalty,
                   repetition_penalty=params.repetition_penalty, generated=generated, prompt=prompt,
                   allowed=allowed, **more)


@dataclass(frozen=True)
class SeqStep(RowSampling):
    seq_id: int
    token_ids: list[int]
    positions: list[int]
    slots: list[int]
    block_table: list[int]
    context_len: int  # tokens in the cache once this step's are written
    sample: bool


@dataclass(frozen=True)
class StepPlan:
    step_id: int
    # "run" | "score" (one no-cache prefill of seqs[0].token_ids) | "stop"
    # | "idle" (a heartbeat: keeps the group's collectives alive, so a dead rank shows when idle)
    kind: str
    seqs: list[SeqStep] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.seqs)


@dataclass(slots=True)
class TokenEvent:
    """One sampled token, the one object it is from the sampler to the Relay message: the step's
    result carries it (across ranks with PP), and the engine hands the same object to its
    request's event sink, with ``text`` set when the request has a detokenizer (text wanted, or
    stop strings to match)."""

    seq_id: int
    token_id: int
    logprob: float
    top_logprobs: list[tuple[int, float]] = field(default_factory=list)
    text: str = ""


@dataclass(frozen=True)
class StepResult:
    step_id: int
    sampled: list[TokenEvent]
    forward_s: float = 0.0  # last stage's forward + sampling time, for Stats/bench
