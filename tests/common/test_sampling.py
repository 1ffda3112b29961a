"""The one sampling validator accepts only what the proto's wire types carry."""

from __future__ import annotations

import pytest

from services.common.proto_convert import sampling_from_pb, sampling_to_pb
from services.common.sampling import InvalidRequest, SamplingParams, as_float32


@pytest.mark.parametrize(("fields", "message"), [
    ({"temperature": 1e39}, r"temperature must fit a 32-bit float \(at most ~3.4e38\), got 1e\+39"),
    ({"top_p": 5e-324}, r"top_p must be in \(0, 1\] as a 32-bit float"),
    ({"top_k": 2**32}, r"top_k must be at most 2\*\*32 - 1, got 4294967296"),
    ({"max_tokens": 2**31}, r"max_tokens must be at most 2\*\*31 - 1, got 2147483648"),
    ({"stop_token_ids": [1, 2**32 + 5]}, r"stop_token_ids must be at most 2\*\*32 - 1, got 4294967301"),
    ({"first_step": 2**32}, r"first_step must be at most 2\*\*32 - 1, got 4294967296"),
    ({"first_step": -1}, r"first_step must be an integer >= 0, got -1"),
    ({"first_step": 2**32 - 16, "max_tokens": 16},
     r"first_step \+ max_tokens must be at most 2\*\*32 - 1, got 4294967280 \+ 16 = 4294967296"),
])
def test_values_the_wire_cannot_carry_are_rejected(fields: dict, message: str) -> None:
    with pytest.raises(InvalidRequest, match=message):
        SamplingParams(**fields)


def test_the_largest_values_the_wire_carries_survive_the_round_trip() -> None:
    params = SamplingParams(temperature=3.4e38, top_p=1.5e-45, top_k=2**32 - 1, max_tokens=2**31 - 1,
                            stop_token_ids=(2**32 - 1,), seed=2**64 - 1)
    back = sampling_from_pb(sampling_to_pb(params))
    assert (back.top_k, back.max_tokens, back.stop_token_ids, back.seed) == (2**32 - 1, 2**31 - 1, (2**32 - 1,),
                                                                             2**64 - 1)
    assert back.temperature == as_float32(3.4e38) and back.top_p == as_float32(1.5e-45) > 0


def test_as_float32_rounds_like_the_wire() -> None:
    assert as_float32(0.1) != 0.1 and as_float32(as_float32(0.1)) == as_float32(0.1)
    assert as_float32(1e39) == float("inf") and as_float32(-1e39) == float("-inf")
    assert as_float32(5e-324) == 0.0


def test_first_step_crosses_the_wire_and_defaults_to_zero() -> None:
    assert sampling_from_pb(sampling_to_pb(SamplingParams())).first_step == 0
    last = SamplingParams(first_step=2**32 - 2, max_tokens=1)  # the last step index the field holds
    assert sampling_from_pb(sampling_to_pb(last)) == last
