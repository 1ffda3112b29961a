"""The dtypes shardline knows: one table of names, aliases, sizes and the spellings other
formats use (the registry's short names, safetensors codes, the proto enum).

Canonical names are ``float16``, ``bfloat16``, ``float32``, ``int8`` (int8 weights with
per-output-channel scales, activations quantized to int8 per group of 32 at each matmul) and
``fp8`` (e4m3 weights with per-output-channel scales); ``fp16``/``bf16``/``fp32`` and a few
more are accepted aliases. Every layer that takes a dtype from a user goes through
:func:`canonical_dtype`, so a name means the same thing everywhere.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class DType:
    """How one serving dtype stores weights and activations.

    ``weight_bytes`` is the storage per element of a decoder linear weight (q/k/v/o, gate/up/down).
    Weight-only quantized dtypes (``int8``, ``fp8``) also keep one scale per output channel
    (``scale_bytes`` each, float32). They quantize the lm_head as well (and with it a tied
    embedding, the one table both use); an untied embedding and the norms stay in the
    activation dtype. ``activation_bytes`` is the element size of
    activations, of the all-reduce and send/recv messages, and of the KV cache.
    """

    name: str
    short_name: str  # the registry's ``dtype`` column and file names: fp16, bf16, fp32, int8, fp8
    weight_bytes: int
    activation_bytes: int
    proto_enum: str  # the value's name in common.proto's ``Dtype``
    scale_bytes: int = 0
    compute: str = "16bit"  # which peak FLOP/s of a topology applies: "16bit", "fp32" or "int8"
    safetensors_code: str | None = None  # how a dense tensor of this dtype is stored

    @property
    def quantized(self) -> bool:
        return self.scale_bytes > 0


# In the order ``--dtype any`` searches them (and ties prefer); also the registry CHECK's order.
DTYPES: dict[str, DType] = {
    "float16": DType("float16", "fp16", 2, 2, "DTYPE_FLOAT16", safetensors_code="F16"),
    "bfloat16": DType("bfloat16", "bf16", 2, 2, "DTYPE_BFLOAT16", safetensors_code="BF16"),
    "float32": DType("float32", "fp32", 4, 4, "DTYPE_FLOAT32", compute="fp32", safetensors_code="F32"),
    "int8": DType("int8", "int8", 1, 2, "DTYPE_INT8", scale_bytes=4, compute="int8"),
    "fp8": DType("fp8", "fp8", 1, 2, "DTYPE_FP8", scale_bytes=4),
}
DTYPE_ALIASES: dict[str, str] = {
    "fp16": "float16",
    "half": "float16",
    "bf16": "bfloat16",
    "fp32": "float32",
    "float": "float32",
    "fp8_e4m3": "fp8",
    "float8_e4m3fn": "fp8",
}
# What a model's weights and activations can be stored in as plain tensors (no scales).
DENSE_DTYPES: tuple[str, ...] = tuple(name for name, d in DTYPES.items() if not d.quantized)


class UnknownDtype(ValueError):
    """A dtype name that is not in the table (or not among the ones a caller accepts)."""


def lookup_dtype(name: str, among: Iterable[str] = DTYPES) -> str | None:
    """The canonical name of ``name`` (any case, alias, or ``torch.`` prefix) if it is in
    ``among``, else None."""
    key = str(name).strip().removeprefix("torch.").lower()
    key = DTYPE_ALIASES.get(key, key)
    return key if key in tuple(among) else None


def accepted_dtypes(among: Iterable[str] = DTYPES) -> str:
    """What an error about a dtype says is accepted: ``one of [...] (aliases [...])``."""
    accepted = tuple(among)
    aliases = sorted(alias for alias, target in DTYPE_ALIASES.items() if target in accepted)
    return f"one of {sorted(accepted)} (aliases {aliases})"


def canonical_dtype(name: str, among: Iterable[str] = DTYPES, *, error: type[Exception] = UnknownDtype) -> str:
    """``bf16`` -> ``bfloat16``: the one rule for a dtype name, in every layer. A name not
    ``among`` the accepted raises ``error`` (each layer its own kind: a bad request, a bad model
    config, a bad spec) with a message naming what is accepted."""
    key = lookup_dtype(name, among)
    if key is None:
        raise error(f"unknown dtype {name!r}: expected {accepted_dtypes(among)}")
    return key


def dtype_info(name: str) -> DType:
    return DTYPES[canonical_dtype(name)]
