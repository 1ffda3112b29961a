"""ParallelPlan: how one replica group splits a model — TP degree, PP degree, layer ranges."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from services.common.dtypes import DENSE_DTYPES, DTYPES, canonical_dtype
from services.common.numerics import DEFAULT_NUMERICS, INVARIANT_MAX_TP, LAYOUT_INVARIANT, NUMERICS, PER_LAYOUT
from services.modeling.compressed_tensors import CompressedTensorsError, compressed_format
from services.modeling.config import CALIBRATION_KEY, ModelConfig, ModelConfigError, torch_dtype
from services.modeling.quant import QuantScheme, scheme_for, scheme_record

# The activation dtype of a quantized plan unless it names one.
DEFAULT_QUANT_ACTIVATION_DTYPE = "bfloat16"



def tp_problem(config: ModelConfig, tp: int) -> str | None:
    """Why ``tp`` cannot split ``config`` (heads, MLP, vocabulary, KV heads), or None."""
    if tp < 1:
        return f"tp_degree must be >= 1, got {tp}"
    for name, value in (("num_attention_heads", config.num_attention_heads),
                        ("intermediate_size", config.intermediate_size), ("vocab_size", config.vocab_size)):
        if value % tp:
            return f"tp_degree={tp} does not divide {name}={value}"
    kv = config.num_key_value_heads
    if (tp <= kv and kv % tp) or (tp > kv and tp % kv):
        return (f"tp_degree={tp} does not divide num_key_value_heads={kv} "
                f"(nor is it a multiple of it, which would replicate KV heads)")
    return None


def supported_tp_degrees(config: ModelConfig) -> list[int]:
    """Every tensor-parallel degree the model's shape allows."""
    return [tp for tp in range(1, config.num_attention_heads + 1) if tp_problem(config, tp) is None]


def invariant_tp_degrees(config: ModelConfig) -> list[int]:
    """The TP degrees that give the same bits in the layout-invariant numerics (every PP degree does)."""
    return [tp for tp in supported_tp_degrees(config) if tp <= INVARIANT_MAX_TP]


def invariant_chunks(config: ModelConfig) -> int:
    """The k-chunks of a row-parallel layer in the layout-invariant mode: the least common
    multiple of :func:`invariant_tp_degrees`, so that each one's slice is a union of chunks."""
    return math.lcm(*invariant_tp_degrees(config))


def layer_split(num_layers: int, pp_degree: int) -> list[range]:
    """Contiguous layer ranges per stage. When PP does not divide the layers, the stages just
    *before* the last get one extra layer each (vLLM's rule, which the planner's cost model
    uses too): the last stage already carries the final norm and lm_head, stage 0 the embedding."""
    if pp_degree < 1 or pp_degree > num_layers:
        raise ModelConfigError(f"pp_degree={pp_degree} must be between 1 and num_hidden_layers={num_layers}")
    base, extra = divmod(num_layers, pp_degree)
    sizes = [base] * pp_degree
    for i in range(2, extra + 2):
        sizes[-i] += 1
    ranges, start = [], 0
    for n in sizes:
        ranges.append(range(start, start + n))
        start += n
    return ranges


@dataclass(frozen=True)
class ParallelPlan:
    """A TP×PP layout for one model; validated against the model's shape at construction.

    Global rank layout: ``global_rank = pp_stage * tp_degree + tp_rank``.

    ``dtype`` is the serving dtype: a dense one (weights and activations alike) or a quantized one
    (``int8``, ``fp8``: the decoder's linear weights quantized per output channel, see
    :mod:`services.modeling.quant`), whose activations, KV cache and messages are in
    ``activation_dtype`` (bfloat16 unless given; float32 allowed). The embedding and the norms stay
    in the activation dtype. ``quantize_lm_head`` quantizes the lm_head too; with tied embeddings
    that is the one table both use, so the embedding then dequantizes the rows it looks up (its
    output is still in the activation dtype): a tied model's table is a fifth of SmolLM2-135M's
    weights, and keeping it dense would leave the plan at 0.61 of the bfloat16 bytes. Unset
    (None), it is on, but for a compressed-tensors checkpoint that left its lm_head dense.
    """

    config: ModelConfig
    tp_degree: int = 1
    pp_degree: int = 1
    dtype: str = "float32"
    activation_dtype: str | None = field(default=None, kw_only=True)
    quantize_lm_head: bool | None = field(default=None, kw_only=True)
    numerics: str = field(default=DEFAULT_NUMERICS, kw_only=True)  # services/common/numerics.py

    def __post_init__(self) -> None:
        name = canonical_dtype(self.dtype, error=ModelConfigError)
        object.__setattr__(self, "dtype", name)
        activation_name = self.activation_dtype or (DEFAULT_QUANT_ACTIVATION_DTYPE if DTYPES[name].quantized else name)
        activation = canonical_dtype(activation_name, DENSE_DTYPES, error=ModelConfigError)
        if not DTYPES[name].quantized and activation != name:
            raise ModelConfigError(f"a dense plan computes in its own dtype: dtype={name}, "
                                   f"activation_dtype={activation}")
        object.__setattr__(self, "activation_dtype", activation)
        cfg, tp = self.config, self.tp_degree
        calibrated = (cfg.raw.get(CALIBRATION_KEY) or {}).get("scheme")
        if calibrated and DTYPES[name].quantized and calibrated != name:
            raise ModelConfigError(f"these weights were calibrated for {calibrated} (shardline quantize): a {name} "
                                   f"plan would round them again onto another grid; calibrate the original "
                                   f"model for {name}, or serve this copy as {calibrated}")
        try:
            compressed = compressed_format(cfg.raw)
        except CompressedTensorsError as exc:
            raise ModelConfigError(str(exc)) from None
        if self.quantize_lm_head is None:
            object.__setattr__(self, "quantize_lm_head", not (compressed and "lm_head" in compressed.ignore))
        if compressed and DTYPES[name].quantized and compressed.scheme.name != name:
            raise ModelConfigError(f"these weights are a {compressed.describe()} checkpoint: a {name} plan would "
                                   f"round them again onto another grid; serve them as {compressed.scheme.name}, "
                                   f"or dense (bfloat16, float32)")
        problem = tp_problem(cfg, tp)
        if problem is not None:
            raise ModelConfigError(problem)
        if self.numerics not in NUMERICS:
            raise ModelConfigError(f"numerics must be one of {', '.join(NUMERICS)}, got {self.numerics!r}")
        if self.numerics == LAYOUT_INVARIANT and tp not in invariant_tp_degrees(cfg):
            degrees = ", ".join(map(str, invariant_tp_degrees(cfg)))
            raise ModelConfigError(f"tp_degree={tp} is beyond the layout-invariant numerics, which give this model "
                                   f"the same bits at TP {degrees}: serve it with numerics {PER_LAYOUT}")
        layer_split(cfg.num_hidden_layers, self.pp_degree)  # validates pp

    @property
    def torch_dtype(self) -> torch.dtype:
        """The activation dtype (the weights' too, for a dense plan)."""
        return torch_dtype(self.activation_dtype)

    @property
    def weight_quant(self) -> QuantScheme | None:
        """The decoder linear weights' quantization scheme; None for a dense plan."""
        return scheme_for(self.dtype)

    @property
    def lm_head_quant(self) -> QuantScheme | None:
        return self.weight_quant if self.quantize_lm_head else None

    @property
    def quantization(self) -> dict[str, object] | None:
        """The scheme record a checkpoint of this plan carries; None for a dense plan."""
        scheme = self.weight_quant
        return None if scheme is None else scheme_record(scheme, lm_head=self.quantize_lm_head)

    @property
    def invariant_chunks(self) -> int:
        """k-chunks of each row-parallel layer; 0 in the per-layout numerics (no chunking)."""
        return invariant_chunks(self.config) if self.numerics == LAYOUT_INVARIANT else 0

    @property
    def world_size(self) -> int:
        return self.tp_degree * self.pp_degree

    @property
    def layer_ranges(self) -> list[range]:
        return layer_split(self.config.num_hidden_layers, self.pp_degree)

    def stage_layers(self, pp_stage: int) -> range:
        return self.layer_ranges[pp_stage]

    def rank_of(self, pp_stage: int, tp_rank: int) -> int:
        return pp_stage * self.tp_degree + tp_rank

    def coords(self, global_rank: int) -> tuple[int, int]:
        """(pp_stage, tp_rank) of a global rank."""
        return divmod(global_rank, self.tp_degree)

    @property
    def kv_heads_per_rank(self) -> int:
        """KV heads a rank stores: kv/tp, or 1 (replicated) when TP exceeds the KV heads."""
        return max(1, self.config.num_key_value_heads // self.tp_degree)
