"""The registry's dtype names: the short ones its column and file names use, and the project's."""

from __future__ import annotations

import pytest

from services.common.registry import InvalidValue, to_project_dtype, to_registry_dtype


@pytest.mark.parametrize(("name", "short", "project"), [
    ("float16", "fp16", "float16"), ("fp16", "fp16", "float16"),
    ("bfloat16", "bf16", "bfloat16"), ("BF16", "bf16", "bfloat16"),
    ("float32", "fp32", "float32"), ("fp32", "fp32", "float32"),
    ("int8", "int8", "int8"), ("fp8", "fp8", "fp8"),
])
def test_dtype_names(name: str, short: str, project: str) -> None:
    assert to_registry_dtype(name) == short
    assert to_project_dtype(name) == project


def test_dtype_unknown() -> None:
    with pytest.raises(InvalidValue) as info:
        to_registry_dtype("float64")
    assert str(info.value) == ("unknown dtype 'float64': expected one of ['bfloat16', 'float16', 'float32', "
                               "'fp8', 'int8'] or the short names ['bf16', 'fp16', 'fp32', 'fp8', 'int8']")
