"""Protobuf <-> domain for the messages several services share: sampling parameters, finish
reasons and dtypes. The worker's and the router's servers and the router's worker client all
convert through here, so a field's default or an enum's meaning is written once.
"""

from __future__ import annotations

from services.common.dtypes import DTYPES
from services.common.proto import common_pb2
from services.common.sampling import (
    DEFAULT_MAX_TOKENS,
    DEFAULT_TEMPERATURE,
    DEFAULT_TOP_P,
    FinishReason,
    SamplingParams,
)

FINISH_REASON_TO_PB: dict[FinishReason, int] = {
    reason: common_pb2.FinishReason.Value(f"FINISH_REASON_{reason.name}") for reason in FinishReason}
FINISH_REASON_FROM_PB: dict[int, FinishReason] = {value: reason for reason, value in FINISH_REASON_TO_PB.items()}
DTYPE_TO_PB: dict[str, int] = {name: common_pb2.Dtype.Value(d.proto_enum) for name, d in DTYPES.items()}
DTYPE_FROM_PB: dict[int, str] = {value: name for name, value in DTYPE_TO_PB.items()}


def sampling_from_pb(pb: common_pb2.SamplingParameters) -> SamplingParams:
    """The message with common.proto's documented defaults for unset optional fields;
    raises InvalidRequest for a value out of range."""
    return SamplingParams(
        temperature=pb.temperature if pb.HasField("temperature") else DEFAULT_TEMPERATURE,
        top_p=pb.top_p if pb.HasField("top_p") else DEFAULT_TOP_P,
        top_k=pb.top_k,
        seed=pb.seed if pb.HasField("seed") else None,
        max_tokens=pb.max_tokens if pb.HasField("max_tokens") else DEFAULT_MAX_TOKENS,
        stop=tuple(pb.stop), stop_token_ids=tuple(pb.stop_token_ids), logprobs=pb.logprobs,
        ignore_eos=pb.ignore_eos, first_step=pb.first_step, cache_salt=pb.cache_salt or None,
        min_p=pb.min_p, logit_bias=tuple(pb.logit_bias.items()), min_tokens=pb.min_tokens,
        presence_penalty=pb.presence_penalty, frequency_penalty=pb.frequency_penalty,
        repetition_penalty=pb.repetition_penalty if pb.HasField("repetition_penalty") else 1.0,
        guide=(pb.guide.kind, pb.guide.spec) if pb.HasField("guide") else None)


def sampling_to_pb(params: SamplingParams) -> common_pb2.SamplingParameters:
    pb = common_pb2.SamplingParameters(
        temperature=params.temperature, top_p=params.top_p, top_k=params.top_k, max_tokens=params.max_tokens,
        stop=list(params.stop), stop_token_ids=list(params.stop_token_ids), logprobs=params.logprobs,
        ignore_eos=params.ignore_eos, first_step=params.first_step, cache_salt=params.cache_salt or "",
        min_p=params.min_p, logit_bias=dict(params.logit_bias), min_tokens=params.min_tokens,
        presence_penalty=params.presence_penalty, frequency_penalty=params.frequency_penalty)
    if params.repetition_penalty != 1:
        pb.repetition_penalty = params.repetition_penalty
    if params.guide is not None:
        pb.guide.kind, pb.guide.spec = params.guide
    if params.seed is not None:
        pb.seed = params.seed
    return pb


def finish_reason_from_pb(value: int) -> FinishReason:
    """An unknown or unset reason reads as ERROR: the stream ended without saying why."""
    return FINISH_REASON_FROM_PB.get(value, FinishReason.ERROR)


def dtype_to_pb(name: str) -> int:
    """DTYPE_UNSPECIFIED for a name the table does not know."""
    return DTYPE_TO_PB.get(name, common_pb2.DTYPE_UNSPECIFIED)
