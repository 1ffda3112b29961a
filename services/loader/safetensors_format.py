"""The safetensors file format, read and written by hand so shards can be streamed.

A file is ``u64 little-endian N`` + an ``N``-byte JSON header + the raw tensor bytes. The header
maps each tensor name to ``{"dtype": "F32", "shape": [...], "data_offsets": [begin, end]}``
(offsets relative to the first byte after the header) and may hold a ``__metadata__`` dict of
string → string. Writing the header first (every shape and dtype is known from the rank's model
before any weight is read) lets the writer emit one tensor at a time and never hold a shard.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, BinaryIO

from services.common.dtypes import DENSE_DTYPES, DTYPES, lookup_dtype

# safetensors dtype code <-> our canonical dtype names, and bytes per element
# Tensor storage dtypes: the dense ones, and a quantized checkpoint's weights (int8, e4m3 as "fp8").
SAFETENSORS_DTYPES: dict[str, str] = {**{name: DTYPES[name].safetensors_code for name in DENSE_DTYPES},
                                      "int8": "I8", "fp8": "F8_E4M3"}
DTYPE_OF_CODE: dict[str, str] = {code: name for name, code in SAFETENSORS_DTYPES.items()}
ITEMSIZE: dict[str, int] = {**{name: DTYPES[name].weight_bytes for name in DENSE_DTYPES}, "int8": 1, "fp8": 1}
HEADER_ALIGNMENT = 8
# A header bigger than this is not a shard header but garbage (or an attack on the parser).
MAX_HEADER_BYTES = 100 * 1024 * 1024
LENGTH_PREFIX = struct.Struct("<Q")

if TYPE_CHECKING:  # the format itself needs no torch: a loader that only reads headers never imports it
    import torch


class SafetensorsFormatError(ValueError):
    """The bytes are not a well-formed safetensors file (bad length, header JSON or offsets)."""


@dataclass(frozen=True)
class TensorHeader:
    """One tensor's entry in a safetensors header. ``dtype`` is a canonical name (float32 …)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


@dataclass(frozen=True)
class SafetensorsHeader:
    """A parsed header: tensors in file order, the metadata, and where the data starts."""

    tensors: tuple[TensorHeader, ...]
    metadata: dict[str, str]
    header_bytes: int  # the JSON's length, not counting the 8-byte prefix

    @property
    def data_start(self) -> int:
        return LENGTH_PREFIX.size + self.header_bytes

    @property
    def file_bytes(self) -> int:
        """The size a complete file with this header has."""
        return self.data_start + max((t.end for t in self.tensors), default=0)

    def by_name(self) -> dict[str, TensorHeader]:
        return {t.name: t for t in self.tensors}


def dtype_code(dtype: str) -> str:
    try:
        return SAFETENSORS_DTYPES[dtype]
    except KeyError:
        raise SafetensorsFormatError(f"dtype {dtype!r} has no safetensors code here: expected one of "
                                     f"{sorted(SAFETENSORS_DTYPES)}") from None


def canonical_dtype_of(dtype: torch.dtype) -> str:
    name = lookup_dtype(str(dtype))
    if name not in SAFETENSORS_DTYPES:
        raise SafetensorsFormatError(f"tensor dtype {dtype} is not one of {sorted(SAFETENSORS_DTYPES)}")
    return name


def encode_header(tensors: list[tuple[str, str, tuple[int, ...]]], metadata: Mapping[str, str]) -> tuple[bytes, list[TensorHeader]]:
    """Header bytes (length prefix included) for tensors laid out back to back in the given order.

    Returns the bytes and the tensor entries with their offsets. The JSON is padded with spaces
    to a multiple of 8 bytes so the data (and every fp32 tensor in it) starts aligned.
    """
    entries: list[TensorHeader] = []
    header: dict[str, object] = {"__metadata__": {str(k): str(v) for k, v in metadata.items()}}
    offset = 0
    for name, dtype, shape in tensors:
        if name in header:
            raise SafetensorsFormatError(f"tensor {name!r} appears twice")
        numel = 1
        for dim in shape:
            numel *= dim
        nbytes = numel * ITEMSIZE[dtype]
        entries.append(TensorHeader(name, dtype, tuple(shape), offset, offset + nbytes))
        header[name] = {"dtype": dtype_code(dtype), "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % HEADER_ALIGNMENT)
    return LENGTH_PREFIX.pack(len(raw)) + raw, entries


def header_length(prefix: bytes, *, file_bytes: int | None = None) -> int:
    """The JSON header's length from the 8-byte prefix, checked against sane bounds."""
    if len(prefix) < LENGTH_PREFIX.size:
        raise SafetensorsFormatError(f"file is {len(prefix)} bytes: shorter than the 8-byte header length")
    (length,) = LENGTH_PREFIX.unpack(prefix[:LENGTH_PREFIX.size])
    limit = MAX_HEADER_BYTES if file_bytes is None else min(MAX_HEADER_BYTES, file_bytes - LENGTH_PREFIX.size)
    if length > limit:
        raise SafetensorsFormatError(f"header length {length} exceeds {limit} bytes available")
    return length


def parse_header(raw: bytes) -> SafetensorsHeader:
    """Parse the JSON header (without its length prefix) and check its offsets are contiguous."""
    try:
        obj = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise SafetensorsFormatError(f"header is not valid JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise SafetensorsFormatError(f"header is a JSON {type(obj).__name__}, expected an object")
    metadata = obj.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise SafetensorsFormatError("__metadata__ must map strings to strings")
    tensors: list[TensorHeader] = []
    for name, entry in obj.items():
        try:
            code, shape, (begin, end) = entry["dtype"], entry["shape"], entry["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise SafetensorsFormatError(f"tensor {name!r}: header entry {entry!r} lacks dtype/shape/data_offsets") from None
        if code not in DTYPE_OF_CODE:
            raise SafetensorsFormatError(f"tensor {name!r}: dtype {code!r} is not one of {sorted(DTYPE_OF_CODE)}")
        dtype = DTYPE_OF_CODE[code]
        numel = 1
        for dim in shape:
            numel *= int(dim)
        if end - begin != numel * ITEMSIZE[dtype]:
            raise SafetensorsFormatError(f"tensor {name!r}: offsets [{begin}, {end}) hold {end - begin} bytes, "
                                         f"shape {shape} {dtype} needs {numel * ITEMSIZE[dtype]}")
        tensors.append(TensorHeader(name, dtype, tuple(int(d) for d in shape), int(begin), int(end)))
    tensors.sort(key=lambda t: t.begin)
    expected_begin = 0
    for t in tensors:
        if t.begin != expected_begin:
            raise SafetensorsFormatError(f"tensor {t.name!r} starts at byte {t.begin}, expected {expected_begin} "
                                         "(tensor data must be contiguous)")
        expected_begin = t.end
    return SafetensorsHeader(tuple(tensors), dict(metadata), len(raw))


def read_header(stream: BinaryIO, *, file_bytes: int | None = None) -> SafetensorsHeader:
    """Read and parse the header from the start of ``stream`` (which is left after the header)."""
    length = header_length(stream.read(LENGTH_PREFIX.size), file_bytes=file_bytes)
    raw = stream.read(length)
    if len(raw) != length:
        raise SafetensorsFormatError(f"header announces {length} bytes, file has only {len(raw)} after the prefix")
    return parse_header(raw)


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """The raw little-endian bytes of a CPU tensor, without a copy."""
    import torch  # deferred: the format needs no torch, a loader reading headers never imports it

    flat = tensor.detach().contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy()).cast("B")
