"""manifest.json: what a sharded checkpoint holds, and the contract a worker checks it against.

One manifest describes one cut of one model: the model (name, HF config, fingerprint), the plan
it was cut for (tp, pp, dtype, layer split) and one entry per rank — file name, size, sha256,
layer range and every tensor's shape and dtype — and, optionally, the source model's non-weight
files copied beside the shards (config, tokenizer, generation config: :data:`MODEL_FILE_NAMES`),
each with its size and sha256, so a worker given only the checkpoint can tokenize. Shard names
are plain file names that follow :data:`SHARD_NAME_TEMPLATE`; anything that could climb out of
the checkpoint's prefix is refused when the manifest is read, before any file is opened.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from services.common.dtypes import DENSE_DTYPES, DTYPES, canonical_dtype
from services.loader.errors import ManifestError, ObjectNotFound, ShardLayoutError

FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"
SHARD_NAME_TEMPLATE = "model-tp{tp_rank:02d}-pp{pp_stage:02d}.safetensors"
_SHA256_HEX = re.compile(r"[0-9a-f]{64}")
# The source directory's files a checkpoint carries beside its shards when present: what a worker
# needs besides the weights (config.json, the tokenizer, generation defaults). tokenizer.model and
# special_tokens_map.json are the older sentencepiece-era tokenizer files (Llama-2).
MODEL_FILE_NAMES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                    "special_tokens_map.json", "tokenizer.model")


def shard_file_name(tp_rank: int, pp_stage: int) -> str:
    return SHARD_NAME_TEMPLATE.format(tp_rank=tp_rank, pp_stage=pp_stage)


def check_plain_file_name(name: object) -> str:
    """Refuse anything but a plain file name: no separator, no ``..``, not absolute, not empty."""
    if not isinstance(name, str) or not name:
        raise ManifestError(f"shard file name must be a non-empty string, got {name!r}")
    if "/" in name or "\\" in name or name in (".", "..") or ".." in name or name.startswith("~") \
            or "\x00" in name or Path(name).is_absolute():
        raise ManifestError(f"shard file name {name!r} is not a plain file name: path separators, '..' "
                            "and absolute paths are refused")
    return name


def _need(obj: dict[str, Any], key: str, kind: type | tuple[type, ...], where: str) -> Any:
    if not isinstance(obj, dict):
        raise ManifestError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    if key not in obj:
        raise ManifestError(f"{where}: missing field {key!r}")
    value = obj[key]
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        names = kind.__name__ if isinstance(kind, type) else "/".join(k.__name__ for k in kind)
        raise ManifestError(f"{where}.{key}: expected {names}, got {type(value).__name__} {value!r}")
    return value


@dataclass(frozen=True)
class TensorInfo:
    """Shape and dtype (canonical name) of one tensor in a shard: a dense dtype, or a quantized
    weight's ``int8`` / ``fp8`` (e4m3)."""

    shape: tuple[int, ...]
    dtype: str

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ManifestError(f"tensor dtype {self.dtype!r} is not one of {sorted(DTYPES)}")
        if any((not isinstance(d, int)) or d < 0 for d in self.shape):
            raise ManifestError(f"tensor shape {self.shape!r} must be non-negative integers")

    def to_dict(self) -> dict[str, Any]:
        return {"shape": list(self.shape), "dtype": self.dtype}

    def describe(self) -> str:
        return f"{list(self.shape)} {self.dtype}"


@dataclass(frozen=True)
class PlanInfo:
    """The plan a checkpoint was cut for. ``layer_split[s] = (start, end)`` of stage ``s``."""

    tp_degree: int
    pp_degree: int
    dtype: str  # the serving dtype: dense, or int8/fp8 (quantized weights)
    layer_split: tuple[tuple[int, int], ...]
    activation_dtype: str | None = None  # None: ``dtype`` (a dense plan)
    quantization: dict[str, Any] | None = None  # the scheme record of a quantized plan (quant.scheme_record)

    def __post_init__(self) -> None:
        if self.tp_degree < 1 or self.pp_degree < 1:
            raise ManifestError(f"plan needs tp_degree, pp_degree >= 1, got tp={self.tp_degree} pp={self.pp_degree}")
        try:
            object.__setattr__(self, "dtype", canonical_dtype(self.dtype, error=ManifestError))
            activation = self.activation_dtype or (self.dtype if self.dtype in DENSE_DTYPES else None)
            object.__setattr__(self, "activation_dtype", None if activation is None
                               else canonical_dtype(activation, DENSE_DTYPES, error=ManifestError))
        except ManifestError as exc:
            raise ManifestError(f"plan.dtype: {exc}") from None
        if (self.dtype in DENSE_DTYPES) != (self.quantization is None) or \
                (self.quantization is not None and self.activation_dtype is None):
            raise ManifestError(f"plan: dtype {self.dtype} with quantization {self.quantization!r} and activation "
                                f"dtype {self.activation_dtype!r}: a quantized dtype needs both, a dense one neither")
        if len(self.layer_split) != self.pp_degree:
            raise ManifestError(f"plan.layer_split has {len(self.layer_split)} stages, pp_degree is {self.pp_degree}")
        expected_start = 0
        for stage, (start, end) in enumerate(self.layer_split):
            if start != expected_start or end <= start:
                raise ManifestError(f"plan.layer_split stage {stage} is [{start}, {end}): expected a non-empty "
                                    f"range starting at layer {expected_start} (stages are contiguous)")
            expected_start = end

    @property
    def num_layers(self) -> int:
        return self.layer_split[-1][1]

    def describe(self) -> str:
        quant = f" activations={self.activation_dtype}" if self.quantization else ""
        return (f"tp={self.tp_degree} pp={self.pp_degree} dtype={self.dtype}{quant} "
                f"layers={[list(r) for r in self.layer_split]}")

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"tp_degree": self.tp_degree, "pp_degree": self.pp_degree, "dtype": self.dtype,
                               "layer_split": [list(r) for r in self.layer_split]}
        if self.quantization is not None:
            out |= {"activation_dtype": self.activation_dtype, "quantization": self.quantization}
        return out

    @classmethod
    def from_dict(cls, obj: Any) -> PlanInfo:
        split = _need(obj, "layer_split", list, "plan")
        if not all(isinstance(r, list) and len(r) == 2 and all(isinstance(x, int) for x in r) for r in split):
            raise ManifestError(f"plan.layer_split must be a list of [start, end] pairs, got {split!r}")
        quantization = obj.get("quantization")
        if quantization is not None and not isinstance(quantization, dict):
            raise ManifestError(f"plan.quantization must be an object, got {quantization!r}")
        activation = obj.get("activation_dtype")
        if activation is not None and not isinstance(activation, str):
            raise ManifestError(f"plan.activation_dtype must be a string, got {activation!r}")
        return cls(tp_degree=_need(obj, "tp_degree", int, "plan"), pp_degree=_need(obj, "pp_degree", int, "plan"),
                   dtype=_need(obj, "dtype", str, "plan"), layer_split=tuple((a, b) for a, b in split),
                   activation_dtype=activation, quantization=quantization)


@dataclass(frozen=True)
class ShardEntry:
    """One rank's file: where it is, what it weighs, what it holds."""

    file: str
    tp_rank: int
    pp_stage: int
    bytes: int
    sha256: str
    layer_start: int
    layer_end: int
    tensors: dict[str, TensorInfo] = field(default_factory=dict)

    def __post_init__(self) -> None:
        check_plain_file_name(self.file)
        expected = shard_file_name(self.tp_rank, self.pp_stage)
        if self.file != expected:
            raise ManifestError(f"shard of tp_rank={self.tp_rank} pp_stage={self.pp_stage} is named {self.file!r}, "
                                f"expected {expected!r}")
        if self.bytes < 8:
            raise ManifestError(f"{self.file}: bytes={self.bytes} is too small for a safetensors file")
        if not _SHA256_HEX.fullmatch(self.sha256):
            raise ManifestError(f"{self.file}: sha256 {self.sha256!r} is not 64 lowercase hex digits")
        if not self.tensors:
            raise ManifestError(f"{self.file}: lists no tensors")

    @property
    def layer_range(self) -> range:
        return range(self.layer_start, self.layer_end)

    def to_dict(self) -> dict[str, Any]:
        return {"file": self.file, "tp_rank": self.tp_rank, "pp_stage": self.pp_stage, "bytes": self.bytes,
                "sha256": self.sha256, "layer_start": self.layer_start, "layer_end": self.layer_end,
                "tensors": {name: info.to_dict() for name, info in self.tensors.items()}}

    @classmethod
    def from_dict(cls, obj: Any, index: int) -> ShardEntry:
        where = f"shards[{index}]"
        name = check_plain_file_name(_need(obj, "file", str, where))
        where = f"shards[{index}] ({name})"
        raw_tensors = _need(obj, "tensors", dict, where)
        tensors = {}
        for tname, info in raw_tensors.items():
            shape = _need(info, "shape", list, f"{where}.tensors.{tname}")
            tensors[tname] = TensorInfo(tuple(shape), _need(info, "dtype", str, f"{where}.tensors.{tname}"))
        return cls(file=name, tp_rank=_need(obj, "tp_rank", int, where), pp_stage=_need(obj, "pp_stage", int, where),
                   bytes=_need(obj, "bytes", int, where), sha256=_need(obj, "sha256", str, where),
                   layer_start=_need(obj, "layer_start", int, where), layer_end=_need(obj, "layer_end", int, where),
                   tensors=tensors)


@dataclass(frozen=True)
class ModelFile:
    """A non-weight file of the source model copied beside the shards (e.g. tokenizer.json)."""

    file: str
    bytes: int
    sha256: str

    def __post_init__(self) -> None:
        check_plain_file_name(self.file)
        if self.file == MANIFEST_NAME or self.file.endswith(".safetensors"):
            raise ManifestError(f"model file {self.file!r} would collide with the manifest or a shard")
        if isinstance(self.bytes, bool) or not isinstance(self.bytes, int) or self.bytes < 0:
            raise ManifestError(f"{self.file}: bytes must be a non-negative integer, got {self.bytes!r}")
        if not _SHA256_HEX.fullmatch(self.sha256):
            raise ManifestError(f"{self.file}: sha256 {self.sha256!r} is not 64 lowercase hex digits")

    def to_dict(self) -> dict[str, Any]:
        return {"file": self.file, "bytes": self.bytes, "sha256": self.sha256}

    @classmethod
    def from_dict(cls, obj: Any, index: int) -> ModelFile:
        where = f"model_files[{index}]"
        name = check_plain_file_name(_need(obj, "file", str, where))
        where = f"model_files[{index}] ({name})"
        return cls(file=name, bytes=_need(obj, "bytes", int, where), sha256=_need(obj, "sha256", str, where))


@dataclass(frozen=True)
class Manifest:
    """A sharded checkpoint: the model, the plan, one :class:`ShardEntry` per (tp_rank, pp_stage).

    Invariants (checked here): every rank of the plan has exactly one shard, its layer range is
    the plan's range for its stage, and ``total_bytes`` is the sum of the shard sizes (the model
    files are not weights and are not counted). ``model_files`` is optional: manifests written
    before it existed have none, and read the same.
    """

    model_name: str
    model_config: dict[str, Any]
    model_fingerprint: str
    plan: PlanInfo
    shards: tuple[ShardEntry, ...]
    total_bytes: int
    format_version: int = FORMAT_VERSION
    model_files: tuple[ModelFile, ...] = ()

    def __post_init__(self) -> None:
        if self.format_version != FORMAT_VERSION:
            raise ManifestError(f"manifest format_version {self.format_version} is not supported: "
                                f"this build reads version {FORMAT_VERSION}")
        if not _SHA256_HEX.fullmatch(self.model_fingerprint):
            raise ManifestError(f"model_fingerprint {self.model_fingerprint!r} is not 64 lowercase hex digits")
        layers = self.model_config.get("num_hidden_layers")
        if layers != self.plan.num_layers:
            raise ManifestError(f"plan.layer_split covers {self.plan.num_layers} layers, "
                                f"model_config.num_hidden_layers is {layers}")
        seen: dict[tuple[int, int], str] = {}
        for shard in self.shards:
            key = (shard.tp_rank, shard.pp_stage)
            if not (0 <= shard.tp_rank < self.plan.tp_degree and 0 <= shard.pp_stage < self.plan.pp_degree):
                raise ManifestError(f"{shard.file}: tp_rank={shard.tp_rank} pp_stage={shard.pp_stage} is outside "
                                    f"the plan's tp={self.plan.tp_degree} x pp={self.plan.pp_degree}")
            if key in seen:
                raise ManifestError(f"tp_rank={key[0]} pp_stage={key[1]} is listed twice ({seen[key]}, {shard.file})")
            seen[key] = shard.file
            start, end = self.plan.layer_split[shard.pp_stage]
            if (shard.layer_start, shard.layer_end) != (start, end):
                raise ManifestError(f"{shard.file}: layers [{shard.layer_start}, {shard.layer_end}) differ from the "
                                    f"plan's stage {shard.pp_stage} layers [{start}, {end})")
        missing = [shard_file_name(t, p) for p in range(self.plan.pp_degree) for t in range(self.plan.tp_degree)
                   if (t, p) not in seen]
        if missing:
            raise ManifestError(f"the plan tp={self.plan.tp_degree} x pp={self.plan.pp_degree} needs "
                                f"{self.plan.tp_degree * self.plan.pp_degree} shards; the manifest lacks {missing}")
        total = sum(s.bytes for s in self.shards)
        if total != self.total_bytes:
            raise ManifestError(f"total_bytes is {self.total_bytes}, the shards sum to {total}")
        names = [f.file for f in self.model_files]
        repeated = sorted({n for n in names if names.count(n) > 1})
        if repeated:
            raise ManifestError(f"model_files lists {repeated} more than once")

    def model_file(self, name: str) -> ModelFile:
        for entry in self.model_files:
            if entry.file == name:
                return entry
        raise ObjectNotFound(f"the manifest lists no model file {name!r}: it has "
                            f"{[f.file for f in self.model_files] or 'none'}")

    def shard(self, tp_rank: int, pp_stage: int) -> ShardEntry:
        for entry in self.shards:
            if (entry.tp_rank, entry.pp_stage) == (tp_rank, pp_stage):
                return entry
        raise ShardLayoutError(f"no shard for tp_rank={tp_rank} pp_stage={pp_stage}: the manifest was cut for "
                            f"{self.plan.describe()}")

    @property
    def dtype(self) -> str:
        return self.plan.dtype

    # -- JSON -------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        out = {"format_version": self.format_version, "model_name": self.model_name,
               "model_config": self.model_config, "model_fingerprint": self.model_fingerprint,
               "plan": self.plan.to_dict(), "shards": [s.to_dict() for s in self.shards],
               "total_bytes": self.total_bytes}
        if self.model_files:  # optional: absent rather than empty, as in manifests written before it
            out["model_files"] = [f.to_dict() for f in self.model_files]
        return out

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2) + "\n"

    @classmethod
    def from_dict(cls, obj: Any) -> Manifest:
        version = _need(obj, "format_version", int, "manifest")
        if version != FORMAT_VERSION:
            raise ManifestError(f"manifest format_version {version} is not supported: this build reads "
                                f"version {FORMAT_VERSION}")
        shards = _need(obj, "shards", list, "manifest")
        files = _need(obj, "model_files", list, "manifest") if isinstance(obj, dict) and "model_files" in obj else []
        return cls(model_name=_need(obj, "model_name", str, "manifest"),
                   model_config=_need(obj, "model_config", dict, "manifest"),
                   model_fingerprint=_need(obj, "model_fingerprint", str, "manifest"),
                   plan=PlanInfo.from_dict(_need(obj, "plan", dict, "manifest")),
                   shards=tuple(ShardEntry.from_dict(s, i) for i, s in enumerate(shards)),
                   total_bytes=_need(obj, "total_bytes", int, "manifest"), format_version=version,
                   model_files=tuple(ModelFile.from_dict(f, i) for i, f in enumerate(files)))

    @classmethod
    def from_json(cls, text: str | bytes, *, source: str = "manifest") -> Manifest:
        try:
            obj = json.loads(text)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ManifestError(f"{source}: not valid JSON: {exc}") from None
        try:
            return cls.from_dict(obj)
        except ManifestError as exc:
            raise ManifestError(f"{source}: {exc}") from None

    @classmethod
    def load(cls, path: str | Path) -> Manifest:
        return cls.from_json(Path(path).read_bytes(), source=str(path))

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_json())


def shard_metadata(*, tp_degree: int, pp_degree: int, tp_rank: int, pp_stage: int, layer_start: int,
                   layer_end: int, dtype: str, model_fingerprint: str, activation_dtype: str | None = None,
                   quantization: dict[str, Any] | None = None) -> dict[str, str]:
    """The ``__metadata__`` every shard file carries (safetensors metadata values are strings);
    a quantized shard also names its activation dtype and its scheme (JSON)."""
    metadata = {"format": "pt", "format_version": str(FORMAT_VERSION), "model_fingerprint": model_fingerprint,
                "tp_degree": str(tp_degree), "pp_degree": str(pp_degree), "tp_rank": str(tp_rank),
                "pp_stage": str(pp_stage), "layer_start": str(layer_start), "layer_end": str(layer_end),
                "dtype": dtype}
    if quantization is not None:
        metadata |= {"activation_dtype": str(activation_dtype),
                     "quantization": json.dumps(quantization, sort_keys=True, separators=(",", ":"))}
    return metadata


def expected_metadata(manifest: Manifest, entry: ShardEntry) -> dict[str, str]:
    """The metadata ``entry``'s file must carry to belong to ``manifest``."""
    return shard_metadata(tp_degree=manifest.plan.tp_degree, pp_degree=manifest.plan.pp_degree,
                          tp_rank=entry.tp_rank, pp_stage=entry.pp_stage, layer_start=entry.layer_start,
                          layer_end=entry.layer_end, dtype=manifest.plan.dtype,
                          model_fingerprint=manifest.model_fingerprint,
                          activation_dtype=manifest.plan.activation_dtype, quantization=manifest.plan.quantization)
