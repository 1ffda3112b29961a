"""Dtype names: the project's long names and the registry's short names.

The project (CLI, planner, protos) names dtypes ``float32``, ``bfloat16``, ``float16``, ``int8``
(int8 weights and activations) and ``fp8`` (e4m3 weights), accepting ``fp32``/``bf16``/``fp16`` as aliases. The
registry keeps the original schema's short names in its ``dtype`` columns, guarded by the CHECK
``dtype IN ('fp16', 'bf16', 'fp32', 'int8', 'fp8')``.
"""

from __future__ import annotations

from services.common.dtypes import DTYPES

from .errors import InvalidValue

# registry short name -> project name; the order is the CHECK constraint's order
REGISTRY_DTYPES: dict[str, str] = {d.short_name: d.name for d in DTYPES.values()}
PROJECT_DTYPES: dict[str, str] = {project: short for short, project in REGISTRY_DTYPES.items()}


def to_registry_dtype(name: str) -> str:
    """``bfloat16`` or ``bf16`` -> ``bf16``; raises InvalidValue for anything else."""
    key = name.strip().lower()
    if key in REGISTRY_DTYPES:
        return key
    if key in PROJECT_DTYPES:
        return PROJECT_DTYPES[key]
    raise InvalidValue(
        f"unknown dtype {name!r}: expected one of {sorted(PROJECT_DTYPES)} "
        f"or the short names {sorted(REGISTRY_DTYPES)}"
    )


def to_project_dtype(name: str) -> str:
    """``bf16`` or ``bfloat16`` -> ``bfloat16``; raises InvalidValue for anything else."""
    return REGISTRY_DTYPES[to_registry_dtype(name)]
