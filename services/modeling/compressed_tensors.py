"""Checkpoints quantized elsewhere: the compressed-tensors format (llm-compressor's output, which
vLLM loads directly), read without the original weights.

Such a directory's ``config.json`` carries ``quantization_config`` with ``quant_method:
"compressed-tensors"``; each quantized linear layer's ``weight`` holds the codes and
``weight_scale`` (``[N, 1]``) the scales. The schemes read here are the two that are ours exactly:

* **FP8** (``format: "float-quantized"``, weights ``type: "float"``): ``float8_e4m3fn`` codes,
  one scale per output channel — the grid of the ``fp8`` serving dtype;
* **INT8** (``"int-quantized"`` or ``"naive-quantized"``, weights ``type: "int"``): ``int8``
  codes, symmetric (no zero point), one scale per output channel — the ``int8`` dtype's grid.
  (llm-compressor divides by 127.5 where we divide by 127, so a code may be −128; the kernels take
  it like any other.)

The codes and scales are taken **as they are**: a plan of the checkpoint's own scheme holds
exactly the checkpoint's numbers at every TP degree (a column-parallel rank takes its rows and
their scales, a row-parallel rank its columns and every row's scale). Rounding them again from
``scale · code`` would not give them back: the checkpoint's scales need not be ``max|W| / Q``.
A dense plan (bfloat16, float32) multiplies them out on load; a plan of the other scheme is
refused (it would round the checkpoint's values onto a second grid).

Activations: the checkpoint may ask for dynamically quantized activations (``FP8_DYNAMIC``,
``W8A8``, one scale per token); the plan's scheme decides instead: int8 quantizes them per group
of 32 values (finer than per token), fp8 keeps them in bfloat16. A code of -128 (the scale is
``max|row| / 127.5``) is taken as -127 by int8's packing (``quant.pack_int8``). Anything else (group or block scales,
asymmetric weights, packed 4-bit codes, static activation scales, sparsity) is refused with
what it is.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from services.modeling.quant import FP8, INT8, QuantScheme

QUANT_METHOD = "compressed-tensors"
FORMATS = {"float-quantized": FP8, "int-quantized": INT8, "naive-quantized": INT8}
WEIGHT_TYPES = {"float": FP8, "int": INT8}
# a quantized weight's companions in the checkpoint: its scales (read with it), and the tensors
# of schemes refused above, never placed
COMPANION_SUFFIXES = (".weight_scale", ".weight_zero_point", ".weight_g_idx", ".input_scale", ".input_zero_point",
                      ".weight_global_scale", ".input_global_scale")


class CompressedTensorsError(ValueError):
    """A compressed-tensors checkpoint whose scheme this loader does not take."""


@dataclass(frozen=True)
class CompressedFormat:
    """What a compressed-tensors checkpoint holds: the weights' scheme, the modules left dense
    (``ignore``), and the activation quantization it describes (``None``: weights only)."""

    scheme: QuantScheme
    ignore: tuple[str, ...]
    activations: str | None

    def describe(self) -> str:
        acts = f"; activations {self.activations} in the checkpoint, bfloat16 here" if self.activations else ""
        return f"compressed-tensors {self.scheme.name} (per output channel{acts})"


def compressed_format(hf_config: dict[str, Any]) -> CompressedFormat | None:
    """The checkpoint's scheme from its ``config.json``; None when it is not compressed-tensors.

    Raises :class:`CompressedTensorsError` for a compressed-tensors scheme this loader cannot serve."""
    qc = hf_config.get("quantization_config")
    if not isinstance(qc, dict) or qc.get("quant_method") != QUANT_METHOD:
        return None

    def refuse(why: str) -> CompressedTensorsError:
        return CompressedTensorsError(f"compressed-tensors checkpoint: {why}; this loader takes 8-bit weights, "
                                      f"symmetric, one scale per output channel (FP8 e4m3 or INT8)")

    if qc.get("quantization_status", "compressed") != "compressed":
        raise refuse(f"quantization_status is {qc.get('quantization_status')!r}, not 'compressed'")
    if qc.get("sparsity_config"):
        raise refuse("it is sparse (sparsity_config)")
    groups = qc.get("config_groups") or {}
    if not groups:
        raise refuse("no config_groups")
    schemes, activations = set(), set()
    for name, group in groups.items():
        fmt = group.get("format") or qc.get("format")
        weights = group.get("weights") or {}
        if fmt not in FORMATS:
            raise refuse(f"group {name} has format {fmt!r}")
        if weights.get("num_bits") != 8 or weights.get("type") not in WEIGHT_TYPES:
            raise refuse(f"group {name} has {weights.get('num_bits')}-bit {weights.get('type')} weights")
        if WEIGHT_TYPES[weights["type"]] is not FORMATS[fmt]:
            raise refuse(f"group {name} stores {weights['type']} weights in format {fmt}")
        if weights.get("strategy") != "channel" or not weights.get("symmetric", False) or weights.get("dynamic"):
            raise refuse(f"group {name}'s weights are {weights.get('strategy')}-wise, "
                         f"symmetric={weights.get('symmetric')}, dynamic={weights.get('dynamic')}")
        acts = group.get("input_activations")
        if acts:
            if not acts.get("dynamic"):
                raise refuse(f"group {name} has static activation scales")
            activations.add(f"{acts.get('type')}{acts.get('num_bits')} per {acts.get('strategy')}, dynamic")
        if group.get("output_activations"):
            raise refuse(f"group {name} quantizes output activations")
        schemes.add(FORMATS[fmt])
    if len(schemes) != 1:
        raise refuse("its groups mix FP8 and INT8 weights")
    if qc.get("kv_cache_scheme"):
        raise refuse("it quantizes the KV cache")
    return CompressedFormat(schemes.pop(), tuple(qc.get("ignore") or ()), ", ".join(sorted(activations)) or None)


def is_companion(name: str) -> bool:
    """A tensor read with its weight (its scales) or never placed, not a parameter of its own."""
    return name.endswith(COMPANION_SUFFIXES)


def _rows(index: Any) -> Any:
    """The row part of an index into a [rows, columns] weight."""
    return index[0] if isinstance(index, tuple) else index


@dataclass(frozen=True)
class QuantizedPiece:
    """Some rows and columns of a quantized weight: its codes and the float32 scales of its rows."""

    codes: torch.Tensor  # [rows, cols] in the scheme's dtype
    scale: torch.Tensor  # float32 [rows]
    scheme: QuantScheme

    @property
    def shape(self) -> torch.Size:
        return self.codes.shape

    def __getitem__(self, index: Any) -> QuantizedPiece:
        return QuantizedPiece(self.codes[index], self.scale[_rows(index)], self.scheme)

    def dequantized(self) -> torch.Tensor:
        """``scale[n] · code[n, k]`` in float32: the values the checkpoint stands for."""
        return self.codes.float() * self.scale.unsqueeze(1)


class CompressedWeight:
    """A quantized weight in the checkpoint, handed to the layers' loaders like a safetensors
    slice: ``get_shape()``, and indexing that reads only the codes and scales of the rows and
    columns asked for (a :class:`QuantizedPiece`)."""

    def __init__(self, name: str, codes: Any, scale: Any, scheme: QuantScheme) -> None:
        shape, scale_shape = tuple(codes.get_shape()), tuple(scale.get_shape())
        if len(shape) != 2 or scale_shape not in ((shape[0], 1), (shape[0],)):
            raise CompressedTensorsError(f"{name}: codes {shape} with scales {scale_shape}; per-channel scales are "
                                         f"[{shape[0] if shape else '?'}, 1]")
        dtype = codes.get_dtype()
        expected = {FP8.name: "F8_E4M3", INT8.name: "I8"}[scheme.name]
        if dtype != expected:
            raise CompressedTensorsError(f"{name}: codes stored as {dtype}, the checkpoint's {scheme.name} "
                                         f"scheme stores {expected}")
        self.name, self._codes, self._scale, self.scheme = name, codes, scale, scheme
        self._shape = shape

    def get_shape(self) -> list[int]:
        return list(self._shape)

    def __getitem__(self, index: Any) -> QuantizedPiece:
        scale = self._scale[_rows(index)].reshape(-1).to(torch.float32)
        return QuantizedPiece(self._codes[index], scale, self.scheme)
