"""Load this rank's weights from a Hugging Face safetensors checkpoint, slice by slice.

One loader loop and one name-mapping table (vLLM's ``stacked_params_mapping``): checkpoint names
are mapped to this stage's parameter names (q/k/v → qkv_proj, gate/up → gate_up_proj), and each
parameter's ``weight_loader`` reads only this rank's slice through ``safe_open(...).get_slice``.
Tensors of layers owned by other stages are never opened.

A compressed-tensors checkpoint (quantized by llm-compressor) is read the same way: each
quantized weight comes as one source holding its codes and scales
(:mod:`services.modeling.compressed_tensors`), and its scale tensors are not names of their own.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from safetensors import safe_open
from torch import nn

from services.modeling.compressed_tensors import CompressedWeight, compressed_format, is_companion

# (fused parameter part, checkpoint part, shard id)
STACKED_PARAMS_MAPPING: tuple[tuple[str, str, Any], ...] = (
    (".qkv_proj.", ".q_proj.", "q"),
    (".qkv_proj.", ".k_proj.", "k"),
    (".qkv_proj.", ".v_proj.", "v"),
    (".gate_up_proj.", ".gate_proj.", 0),
    (".gate_up_proj.", ".up_proj.", 1),
)
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
# a quantized layer's per-output-channel scales sit beside its weight: ``….weight_scale`` (ours, and
# a compressed-tensors checkpoint's)
SCALE_SUFFIX = "_scale"


class CheckpointError(ValueError):
    """The checkpoint is missing tensors this rank needs, or has ones it cannot place."""


def map_checkpoint_name(name: str) -> tuple[str, Any]:
    """Checkpoint tensor name → (parameter name in our model, shard id or None)."""
    for fused, part, shard_id in STACKED_PARAMS_MAPPING:
        if part in name:
            return name.replace(part, fused), shard_id
    return name, None


class CheckpointReader:
    """Opens the safetensors files of an HF directory lazily; hands out per-tensor slice handles."""

    def __init__(self, model_dir: str | Path) -> None:
        self.model_dir = Path(model_dir)
        index = self.model_dir / "model.safetensors.index.json"
        if index.exists():
            weight_map = json.loads(index.read_text())["weight_map"]
            self._file_of = {name: self.model_dir / fname for name, fname in weight_map.items()}
        else:
            single = self.model_dir / "model.safetensors"
            if not single.exists():
                raise CheckpointError(f"{self.model_dir}: neither model.safetensors nor "
                                      "model.safetensors.index.json found")
            with safe_open(str(single), framework="pt") as handle:
                self._file_of = {name: single for name in handle.keys()}
        self._stack = ExitStack()
        self._handles: dict[Path, Any] = {}
        config = self.model_dir / "config.json"
        self.compressed = compressed_format(json.loads(config.read_text())) if config.exists() else None

    def __enter__(self) -> CheckpointReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._stack.close()
        self._handles.clear()

    def names(self) -> list[str]:
        """The tensors to place: a compressed checkpoint's scales travel with their weights."""
        if self.compressed is None:
            return sorted(self._file_of)
        return sorted(name for name in self._file_of if not is_companion(name))

    def __contains__(self, name: str) -> bool:
        return name in self._file_of

    def get_slice(self, name: str) -> Any:
        """A slice handle; a compressed checkpoint's quantized weight as codes with their scales."""
        scale_name = name + SCALE_SUFFIX
        if self.compressed is not None and name.endswith(".weight") and scale_name in self._file_of:
            return CompressedWeight(name, self._raw_slice(name), self._raw_slice(scale_name), self.compressed.scheme)
        return self._raw_slice(name)

    def _raw_slice(self, name: str) -> Any:
        path = self._file_of[name]
        handle = self._handles.get(path)
        if handle is None:
            handle = self._stack.enter_context(safe_open(str(path), framework="pt"))
            self._handles[path] = handle
        return handle.get_slice(name)


def checkpoint_assignments(params: dict[str, nn.Parameter], names: list[str], *,
                           tie_word_embeddings: bool) -> Iterator[tuple[str, str, Any]]:
    """Yield (checkpoint name, parameter name, shard id) for every tensor this rank needs.

    Tied embeddings: when the checkpoint has no ``lm_head.weight``, a stage holding an lm_head of
    its own (the last stage under PP > 1) takes it from ``model.embed_tokens.weight``.

    Quantize on load: a quantized layer's ``weight_scale`` is computed from the same full-precision
    checkpoint tensor as its ``weight``, so that tensor is assigned to both.
    """
    def with_scale(name: str, param_name: str, shard_id: Any) -> Iterator[tuple[str, str, Any]]:
        yield name, param_name, shard_id
        if param_name.endswith(".weight") and param_name + SCALE_SUFFIX in params:
            yield name, param_name + SCALE_SUFFIX, shard_id

    for name in names:
        if name.endswith(IGNORED_SUFFIXES):
            continue
        param_name, shard_id = map_checkpoint_name(name)
        if param_name in params:
            yield from with_scale(name, param_name, shard_id)
    if tie_word_embeddings and "lm_head.weight" not in names and "lm_head.weight" in params:
        embed_param = params.get("model.embed_tokens.weight")
        if embed_param is None or embed_param is not params["lm_head.weight"]:
            yield from with_scale("model.embed_tokens.weight", "lm_head.weight", None)


def load_weights(model: nn.Module, reader: CheckpointReader, *, tie_word_embeddings: bool) -> int:
    """Fill every parameter of ``model`` from ``reader``; returns the bytes loaded.

    Raises :class:`CheckpointError` naming the parameters no checkpoint tensor filled.
    """
    params = dict(model.named_parameters(remove_duplicate=False))
    filled: dict[str, set[Any]] = {}
    loaded_bytes = 0
    for ckpt_name, param_name, shard_id in checkpoint_assignments(
            params, reader.names(), tie_word_embeddings=tie_word_embeddings):
        param = params[param_name]
        param.weight_loader(param.data, reader.get_slice(ckpt_name), shard_id)
        filled.setdefault(param_name, set()).add(shard_id)
    seen_ids: set[int] = set()
    missing = []
    for name, param in params.items():
        expected = _expected_shard_ids(name)
        got = filled.get(name, set())
        # a tied lm_head shares the embedding's tensor: filled when the embedding was
        if not got and any(param is params[other] and filled.get(other) for other in filled):
            got = expected
        if got != expected:
            missing.append(f"{name} (have {sorted(map(str, got))}, need {sorted(map(str, expected))})")
        if id(param) not in seen_ids:
            seen_ids.add(id(param))
            loaded_bytes += param.numel() * param.element_size()
    if missing:
        raise CheckpointError(f"{reader.model_dir}: checkpoint lacks tensors for: " + "; ".join(missing))
    return loaded_bytes


def _expected_shard_ids(param_name: str) -> set[Any]:
    ids = {shard_id for fused, _, shard_id in STACKED_PARAMS_MAPPING if fused in param_name}
    return ids or {None}
