"""Checks that a shard is exactly what the manifest says and exactly what the worker's plan needs.

The failure designed against is a shard that loads without error but is the wrong one: cut for
another TP degree, another dtype, another stage or another model, or renamed to look right. So a
shard is checked on three sides before any of its bytes reach a model:

1. bytes   — size and sha256 of the whole file equal the manifest's (one streamed pass);
2. header  — the file's ``__metadata__`` (tp/pp degree, rank, layer range, dtype, fingerprint)
             and its tensor list equal the manifest entry's;
3. plan    — the manifest's plan and model config equal the plan the worker runs, and the entry's
             tensors equal what the rank's model (built from that plan) expects, name by name.

The model files a checkpoint carries beside its shards (config, tokenizer) are checked on the
first side only: size and sha256 against the manifest.

Every failure raises :class:`ShardLayoutError` (or :class:`ShardChecksumError`) naming the
expected and the actual value.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO

from services.loader.errors import ManifestError, ObjectNotFound, ShardChecksumError, ShardLayoutError
from services.loader.manifest import MANIFEST_NAME, Manifest, ModelFile, ShardEntry, TensorInfo, expected_metadata
from services.loader.object_store import ObjectStore, open_store, split_object_uri
from services.loader.safetensors_format import (
    LENGTH_PREFIX,
    SafetensorsFormatError,
    SafetensorsHeader,
    header_length,
    parse_header,
)

if TYPE_CHECKING:  # torch's, imported by the checks that build a rank's model when they run
    from services.loader.layout import RankLayout
    from services.modeling.parallel.plan import ParallelPlan

HASH_CHUNK_BYTES = 8 * 1024 * 1024
# ModelConfig fields that change a rank's tensors or its math; a checkpoint must agree on all.
CONFIG_FIELDS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                 "num_key_value_heads", "vocab_size", "head_dim", "rms_norm_eps", "rope_theta", "rope_scaling",
                 "tie_word_embeddings")


@dataclass
class StreamDigest:
    """sha256 and size of a stream, plus its first bytes (where the safetensors header is)."""

    sha256: str
    nbytes: int
    head: bytes = field(repr=False)


def digest_stream(stream: BinaryIO, *, sink: BinaryIO | None = None, chunk_bytes: int = HASH_CHUNK_BYTES,
                  on_bytes: Callable[[int], None] | None = None) -> StreamDigest:
    """One pass over ``stream``: hash every byte, keep the 8-byte prefix and the header it
    announces (if that is a sane length), and copy everything to ``sink`` when given."""
    digest = hashlib.sha256()
    head = bytearray()
    head_bytes: int | None = None  # prefix + header, once the prefix is known
    total = 0
    while chunk := stream.read(chunk_bytes):
        digest.update(chunk)
        if sink is not None:
            sink.write(chunk)
        if head_bytes is None or len(head) < head_bytes:
            head += chunk
            if head_bytes is None and len(head) >= LENGTH_PREFIX.size:
                try:
                    head_bytes = LENGTH_PREFIX.size + header_length(bytes(head[:LENGTH_PREFIX.size]))
                except SafetensorsFormatError:
                    head_bytes = LENGTH_PREFIX.size  # reported after the checksum, which differs too
            if head_bytes is not None:
                del head[head_bytes:]
        total += len(chunk)
        if on_bytes is not None:
            on_bytes(len(chunk))
    return StreamDigest(digest.hexdigest(), total, bytes(head))


def check_bytes(entry: ShardEntry | ModelFile, got: StreamDigest, *, source: str) -> None:
    """Size, then sha256, against the manifest entry (a truncated file is named as such)."""
    if got.nbytes != entry.bytes:
        what = "short: truncated, or another file" if got.nbytes < entry.bytes else "long: another file"
        raise ShardChecksumError(f"{source}: {got.nbytes} bytes, manifest says {entry.bytes} for {entry.file} ({what})")
    if got.sha256 != entry.sha256:
        raise ShardChecksumError(f"{source}: sha256 {got.sha256}, manifest says {entry.sha256} for {entry.file}")


def header_of(got: StreamDigest, *, source: str) -> SafetensorsHeader:
    try:
        length = header_length(got.head[:LENGTH_PREFIX.size], file_bytes=got.nbytes)
        if len(got.head) < LENGTH_PREFIX.size + length:
            raise SafetensorsFormatError(f"header announces {length} bytes, file ends before them")
        header = parse_header(got.head[LENGTH_PREFIX.size:LENGTH_PREFIX.size + length])
    except SafetensorsFormatError as exc:
        raise ShardLayoutError(f"{source}: not a valid safetensors file: {exc}") from None
    if header.file_bytes != got.nbytes:
        raise ShardLayoutError(f"{source}: header describes a {header.file_bytes}-byte file, file has {got.nbytes}")
    return header


def diff_tensors(expected: dict[str, TensorInfo], actual: dict[str, TensorInfo]) -> list[str]:
    """Human-readable differences between two tensor lists ([] when equal)."""
    problems = []
    missing = sorted(set(expected) - set(actual))
    extra = sorted(set(actual) - set(expected))
    if missing:
        problems.append(f"missing {len(missing)} tensor(s) {missing[:4]}{' …' if len(missing) > 4 else ''}")
    if extra:
        problems.append(f"unexpected {len(extra)} tensor(s) {extra[:4]}{' …' if len(extra) > 4 else ''}")
    for name in sorted(set(expected) & set(actual)):
        if expected[name] != actual[name]:
            problems.append(f"{name}: expected {expected[name].describe()}, got {actual[name].describe()}")
    return problems


def check_header(header: SafetensorsHeader, manifest: Manifest, entry: ShardEntry, *, source: str) -> None:
    """The file's metadata and tensor list against the manifest entry it is listed as."""
    expected = expected_metadata(manifest, entry)
    diffs = [f"{key}: expected {value!r}, file has {header.metadata.get(key)!r}"
             for key, value in expected.items() if header.metadata.get(key) != value]
    if diffs:
        raise ShardLayoutError(f"{source}: header metadata does not match manifest entry {entry.file}: "
                               + "; ".join(diffs))
    actual = {t.name: TensorInfo(t.shape, t.dtype) for t in header.tensors}
    problems = diff_tensors(entry.tensors, actual)
    if problems:
        raise ShardLayoutError(f"{source}: tensors differ from manifest entry {entry.file}: " + "; ".join(problems[:6]))


def check_plan(manifest: Manifest, plan: ParallelPlan, *, expected_fingerprint: str | None = None,
               source: str = "checkpoint") -> None:
    """The manifest's plan, model config and fingerprint against the plan this worker runs."""
    got = manifest.plan
    want_split = tuple((r.start, r.stop) for r in plan.layer_ranges)
    diffs = [f"{key}: checkpoint has {a!r}, plan needs {b!r}" for key, a, b in (
        ("tp_degree", got.tp_degree, plan.tp_degree), ("pp_degree", got.pp_degree, plan.pp_degree),
        ("dtype", got.dtype, plan.dtype), ("layer_split", [list(r) for r in got.layer_split],
                                           [list(r) for r in want_split]),
        ("activation_dtype", got.activation_dtype or got.dtype, plan.activation_dtype),
        ("quantization", got.quantization, plan.quantization)) if a != b]
    if diffs:
        raise ShardLayoutError(f"{source} was cut for {got.describe()}, the plan being run is tp={plan.tp_degree} "
                               f"pp={plan.pp_degree} dtype={plan.dtype}: " + "; ".join(diffs))
    from services.modeling.config import ModelConfig  # deferred: torch, for a loader that only registers

    try:
        ckpt_config = ModelConfig.from_dict(manifest.model_config, name=manifest.model_name)
    except (ValueError, KeyError) as exc:
        raise ManifestError(f"{source}: model_config is not a usable Llama config: {exc}") from None
    cfg_diffs = [f"{name}: checkpoint has {getattr(ckpt_config, name)!r}, plan has {getattr(plan.config, name)!r}"
                 for name in CONFIG_FIELDS if getattr(ckpt_config, name) != getattr(plan.config, name)]
    if cfg_diffs:
        raise ShardLayoutError(f"{source} is of another model shape: " + "; ".join(cfg_diffs))
    if expected_fingerprint is not None and manifest.model_fingerprint != expected_fingerprint:
        raise ShardLayoutError(f"{source} is from another model: fingerprint {manifest.model_fingerprint}, "
                               f"this worker's model is {expected_fingerprint}")


def check_entry_layout(entry: ShardEntry, layout: RankLayout, *, source: str) -> None:
    """A manifest entry against what the rank's model holds (rank, layers, tensors)."""
    got = (entry.tp_rank, entry.pp_stage, entry.layer_start, entry.layer_end)
    want = (layout.tp_rank, layout.pp_stage, layout.layer_start, layout.layer_end)
    if got != want:
        raise ShardLayoutError(f"{source}: {entry.file} is tp_rank={got[0]} pp_stage={got[1]} layers [{got[2]}, "
                               f"{got[3]}), this rank is tp_rank={want[0]} pp_stage={want[1]} layers "
                               f"[{want[2]}, {want[3]})")
    problems = diff_tensors(layout.tensors, entry.tensors)
    if problems:
        raise ShardLayoutError(f"{source}: {entry.file} does not hold what this rank's model expects: "
                               + "; ".join(problems[:6]))


@dataclass(frozen=True)
class ShardCheck:
    """A shard that passed: its size, hash and header, and how long the check took."""

    file: str
    bytes: int
    sha256: str
    header: SafetensorsHeader = field(repr=False)
    read_ns: int = 0  # the streamed pass: reading (downloading) and hashing
    check_ns: int = 0  # comparing size, sha256 and header afterwards

    @property
    def verify_ns(self) -> int:
        return self.read_ns + self.check_ns


def verify_stream(stream: BinaryIO, manifest: Manifest, entry: ShardEntry, *, source: str,
                  sink: BinaryIO | None = None, on_bytes: Callable[[int], None] | None = None) -> ShardCheck:
    """Bytes and header of one shard read from ``stream`` (copied to ``sink`` on the way)."""
    start = time.perf_counter_ns()
    got = digest_stream(stream, sink=sink, on_bytes=on_bytes)
    read_done = time.perf_counter_ns()
    try:
        check_bytes(entry, got, source=source)
    except ShardChecksumError as exc:
        raise ShardChecksumError(f"{exc}{_header_hint(got, manifest, entry)}") from None
    header = header_of(got, source=source)
    check_header(header, manifest, entry, source=source)
    return ShardCheck(entry.file, got.nbytes, got.sha256, header, read_done - start,
                      time.perf_counter_ns() - read_done)


def _header_hint(got: StreamDigest, manifest: Manifest, entry: ShardEntry) -> str:
    """When the bytes are wrong but the header still parses, say what the file claims to be:
    'a shard of another rank or plan' is a far better lead than two hashes."""
    try:
        header = header_of(got, source="")
    except ShardLayoutError:
        return ""
    expected = expected_metadata(manifest, entry)
    diffs = [f"{key} {header.metadata.get(key)!r} (expected {value!r})" for key, value in expected.items()
             if header.metadata.get(key) != value]
    return f"; its header says {', '.join(diffs)}" if diffs else ""


@dataclass(frozen=True)
class FileCheck:
    """A model file (config, tokenizer) whose size and sha256 matched the manifest."""

    file: str
    bytes: int
    sha256: str
    verify_ns: int = 0


def verify_model_file_stream(stream: BinaryIO, entry: ModelFile, *, source: str,
                             sink: BinaryIO | None = None) -> FileCheck:
    """Size and sha256 of one model file read from ``stream`` (copied to ``sink`` on the way)."""
    start = time.perf_counter_ns()
    got = digest_stream(stream, sink=sink)
    check_bytes(entry, got, source=source)
    return FileCheck(entry.file, got.nbytes, got.sha256, time.perf_counter_ns() - start)


def _open_listed(path: Path, missing: Exception) -> BinaryIO:
    try:
        return open(path, "rb")
    except FileNotFoundError:
        raise missing from None


def verify_model_file(path: str | Path, entry: ModelFile) -> FileCheck:
    path = Path(path)
    missing = ObjectNotFound(f"{path}: model file {entry.file} listed in the manifest is missing")
    with _open_listed(path, missing) as stream:
        return verify_model_file_stream(stream, entry, source=str(path))


def verify_file(path: str | Path, manifest: Manifest, entry: ShardEntry) -> ShardCheck:
    path = Path(path)
    with _open_listed(path, ShardLayoutError(f"{path}: shard {entry.file} is missing")) as stream:
        return verify_stream(stream, manifest, entry, source=str(path))


def verify_rank_shard(manifest: Manifest, shard_path: str | Path, plan: ParallelPlan, global_rank: int, *,
                      layout: RankLayout | None = None, expected_fingerprint: str | None = None) -> ShardCheck:
    """Everything a worker checks before loading rank ``global_rank``'s shard from ``shard_path``.

    ``layout`` defaults to the rank's model built on ``meta`` from ``plan``.
    """
    from services.loader.layout import RankLayout  # deferred: torch (the rank's model on meta)

    check_plan(manifest, plan, expected_fingerprint=expected_fingerprint, source=str(shard_path))
    layout = layout if layout is not None else RankLayout.for_rank(plan, global_rank)
    entry = manifest.shard(layout.tp_rank, layout.pp_stage)
    check_entry_layout(entry, layout, source=str(shard_path))
    return verify_file(shard_path, manifest, entry)


def read_manifest(manifest_uri: str | Path, *, endpoint_url: str | None = None,
                  store: ObjectStore | None = None) -> tuple[Manifest, ObjectStore]:
    """Read and validate manifest.json at ``manifest_uri`` (a file, a directory holding it, or
    an s3:// URI); returns it with the store its shards live in (the manifest's directory)."""
    root, name = split_object_uri(manifest_uri, default_name=MANIFEST_NAME)
    store = store if store is not None else open_store(root, endpoint_url=endpoint_url)
    return Manifest.from_json(store.read_bytes(name), source=store.uri_for(name)), store


@dataclass(frozen=True)
class VerifyReport:
    manifest: Manifest
    shards: tuple[ShardCheck, ...]
    plan_checked: bool
    model_files: tuple[FileCheck, ...] = ()

    @property
    def total_bytes(self) -> int:
        return sum(s.bytes for s in self.shards)


def verify_checkpoint(manifest_uri: str | Path, *, plan: ParallelPlan | None = None,
                      expected_fingerprint: str | None = None, endpoint_url: str | None = None,
                      store: ObjectStore | None = None, on_bytes: Callable[[int], None] | None = None,
                      on_shard: Callable[[ShardCheck], None] | None = None,
                      on_model_file: Callable[[FileCheck], None] | None = None) -> VerifyReport:
    """Verify every shard of a checkpoint where it is stored (streamed, nothing written), then
    every model file it carries (config, tokenizer: size and sha256).

    With ``plan``, each shard is also checked against that plan's rank models; without, against
    the manifest's own plan — so the tensor lists are always checked against real model shapes.
    """
    # deferred: torch (the rank models on meta), imported by the checks that run, not by the loader's start
    from services.loader.layout import RankLayout
    from services.modeling.config import ModelConfig
    from services.modeling.parallel.plan import ParallelPlan

    manifest, store = read_manifest(manifest_uri, endpoint_url=endpoint_url, store=store)
    if plan is not None:
        check_plan(manifest, plan, expected_fingerprint=expected_fingerprint, source=str(manifest_uri))
        run_plan = plan
    else:
        if expected_fingerprint is not None and expected_fingerprint != manifest.model_fingerprint:
            raise ShardLayoutError(f"{manifest_uri} is from another model: fingerprint {manifest.model_fingerprint}, "
                                   f"expected {expected_fingerprint}")
        config = ModelConfig.from_dict(manifest.model_config, name=manifest.model_name)
        run_plan = ParallelPlan(config, manifest.plan.tp_degree, manifest.plan.pp_degree, manifest.plan.dtype)
        check_plan(manifest, run_plan, source=str(manifest_uri))
    checks: list[ShardCheck] = []
    for entry in _in_rank_order(manifest.shards):
        rank = run_plan.rank_of(entry.pp_stage, entry.tp_rank)
        check_entry_layout(entry, RankLayout.for_rank(run_plan, rank), source=store.uri_for(entry.file))
        with store.open(entry.file) as stream:
            check = verify_stream(stream, manifest, entry, source=store.uri_for(entry.file), on_bytes=on_bytes)
        checks.append(check)
        if on_shard is not None:
            on_shard(check)
    file_checks: list[FileCheck] = []
    for model_file in manifest.model_files:
        with store.open(model_file.file) as stream:
            file_check = verify_model_file_stream(stream, model_file, source=store.uri_for(model_file.file))
        file_checks.append(file_check)
        if on_model_file is not None:
            on_model_file(file_check)
    return VerifyReport(manifest, tuple(checks), plan is not None, tuple(file_checks))



def _in_rank_order(entries: Iterable[ShardEntry]) -> list[ShardEntry]:
    return sorted(entries, key=lambda e: (e.pp_stage, e.tp_rank))
