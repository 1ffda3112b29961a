"""The hand-written safetensors header: readable by the safetensors library, strict when parsed."""

from __future__ import annotations

import io
import json
import struct

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from services.loader.safetensors_format import (
    SafetensorsFormatError,
    encode_header,
    parse_header,
    read_header,
    tensor_bytes,
)


def test_streamed_file_reads_back_with_the_safetensors_library(tmp_path) -> None:
    tensors = {"a": torch.randn(3, 5), "b": torch.randn(7).to(torch.bfloat16), "c": torch.randn(2, 2).half()}
    header, entries = encode_header([(n, str(t.dtype).removeprefix("torch."), tuple(t.shape))
                                     for n, t in tensors.items()], {"tp_rank": "1"})
    assert (len(header) - 8) % 8 == 0
    path = tmp_path / "x.safetensors"
    with open(path, "wb") as f:
        f.write(header)
        for t in tensors.values():
            f.write(tensor_bytes(t))
    with safe_open(str(path), framework="pt") as f:
        assert f.metadata() == {"tp_rank": "1"}
        for name, t in tensors.items():
            got = f.get_tensor(name)
            assert got.dtype == t.dtype and torch.equal(got.view(torch.uint8), t.view(torch.uint8))
    assert [(e.name, e.begin, e.end) for e in entries] == [("a", 0, 60), ("b", 60, 74), ("c", 74, 82)]
    parsed = read_header(open(path, "rb"))
    assert parsed.metadata == {"tp_rank": "1"} and parsed.file_bytes == path.stat().st_size
    assert [t.dtype for t in parsed.tensors] == ["float32", "bfloat16", "float16"]


def test_parses_files_written_by_safetensors(tmp_path) -> None:
    path = tmp_path / "y.safetensors"
    save_file({"w": torch.zeros(4, 4), "n": torch.ones(4)}, str(path), metadata={"k": "v"})
    header = read_header(open(path, "rb"))
    assert {t.name: t.shape for t in header.tensors} == {"w": (4, 4), "n": (4,)}
    assert header.file_bytes == path.stat().st_size


def _raw(header: dict) -> bytes:
    return json.dumps(header).encode()


@pytest.mark.parametrize("header, message", [
    ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}}, "offsets \\[0, 4\\) hold 4 bytes"),
    ({"a": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}, "starts at byte 4, expected 0"),
    ({"a": {"dtype": "I16", "shape": [1], "data_offsets": [0, 2]}}, "dtype 'I16' is not one of"),
    ({"a": {"shape": [1]}}, "lacks dtype/shape/data_offsets"),
    ({"__metadata__": {"x": 1}}, "__metadata__ must map strings to strings"),
])
def test_bad_headers_are_refused(header: dict, message: str) -> None:
    with pytest.raises(SafetensorsFormatError, match=message):
        parse_header(_raw(header))


def test_garbage_and_short_files_are_refused() -> None:
    with pytest.raises(SafetensorsFormatError, match="not valid JSON"):
        parse_header(b"\xff{")
    with pytest.raises(SafetensorsFormatError, match="shorter than the 8-byte header length"):
        read_header(io.BytesIO(b"abc"))
    with pytest.raises(SafetensorsFormatError, match="exceeds"):
        read_header(io.BytesIO(struct.pack("<Q", 1 << 40) + b"{}"))
    with pytest.raises(SafetensorsFormatError, match="file has only 2"):
        read_header(io.BytesIO(struct.pack("<Q", 100) + b"{}"))
