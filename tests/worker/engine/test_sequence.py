"""SamplingParams and Sequence validation: every bad field is named with its rule and value."""

from __future__ import annotations

import pytest

from services.common.errors import InvalidArgument
from services.common.sampling import InvalidRequest, SamplingParams
from services.worker.engine.sequence import Sequence, SequenceStatus


def test_defaults_follow_the_proto() -> None:
    p = SamplingParams()
    assert (p.temperature, p.top_p, p.top_k, p.seed, p.max_tokens, p.logprobs, p.ignore_eos) == (
        1.0, 1.0, 0, None, 16, 0, False)
    assert not p.is_greedy and SamplingParams(temperature=0).is_greedy


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"temperature": -0.5}, "temperature must be a finite number >= 0, got -0.5"),
    ({"temperature": float("nan")}, "temperature must be a finite number >= 0, got nan"),
    ({"top_p": 1.5}, r"top_p must be in \(0, 1\], got 1.5"),
    ({"top_p": 0.0}, r"top_p must be in \(0, 1\], got 0.0"),
    ({"top_k": -1}, r"top_k must be an integer >= 0 \(0 = off\), got -1"),
    ({"seed": -3}, r"seed must be an integer in \[0, 2\*\*64 - 1\], got -3"),
    ({"seed": 2**64}, r"seed must be an integer in \[0, 2\*\*64 - 1\], got 18446744073709551616"),
    ({"max_tokens": 0}, "max_tokens must be an integer >= 1, got 0"),
    ({"max_tokens": True}, "max_tokens must be an integer >= 1, got True"),
    ({"stop_token_ids": [3, -1]}, "stop_token_ids must be integers >= 0, got -1"),
    ({"stop": ["ok", ""]}, "stop strings must be non-empty strings, got ''"),
    ({"logprobs": 21}, r"logprobs must be an integer in \[0, 20\], got 21"),
])
def test_bad_sampling_params_name_the_field(kwargs: dict, message: str) -> None:
    with pytest.raises(InvalidRequest, match=f"^{message}$"):
        SamplingParams(**kwargs)


def test_invalid_request_is_an_invalid_argument() -> None:
    assert issubclass(InvalidRequest, InvalidArgument)
    assert issubclass(InvalidRequest, ValueError)


def test_lists_become_tuples_so_params_are_hashable() -> None:
    p = SamplingParams(stop_token_ids=[1, 2], stop=["\n"])
    assert p.stop_token_ids == (1, 2) and p.stop == ("\n",)
    hash(p)


def test_sequence_rejects_empty_prompt_and_bad_ids() -> None:
    with pytest.raises(InvalidRequest, match="prompt must not be empty, got 0 tokens"):
        Sequence(1, [])
    with pytest.raises(InvalidRequest, match="prompt token ids must be integers >= 0, got -4"):
        Sequence(1, [5, -4])


def test_sequence_token_accounting() -> None:
    s = Sequence(3, [10, 11, 12], SamplingParams(max_tokens=4))
    s.output_token_ids += [20, 21]
    assert s.status is SequenceStatus.WAITING
    assert (s.num_prompt_tokens, s.num_output_tokens, s.num_tokens) == (3, 2, 5)
    assert s.all_token_ids == [10, 11, 12, 20, 21]
    for start in range(6):
        for stop in range(start, 6):
            assert s.token_ids_slice(start, stop) == s.all_token_ids[start:stop]
    s.num_computed_tokens = 4
    assert s.num_uncomputed_tokens == 1
    assert s.max_total_tokens == 7


def test_sampling_step_counts_the_tokens_generated_before_the_prompts_end() -> None:
    fresh = Sequence(1, [10, 11], SamplingParams(seed=3))
    continued = Sequence(2, [10, 11, 20, 21, 22], SamplingParams(seed=3, first_step=3))
    assert (fresh.sampling_step, continued.sampling_step) == (0, 3)
    fresh.output_token_ids += [20, 21, 22]
    continued.output_token_ids += [23]
    assert (fresh.sampling_step, continued.sampling_step) == (3, 4)
