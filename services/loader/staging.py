"""Stage one rank's shard into a node-local cache, verified; a second call is a verified cache hit.
The checkpoint's model files (config, tokenizer) are staged the same way by :func:`stage_model_files`.

The cache is content-addressed: ``cache_dir/<sha256>/<file>``, so two checkpoints can never
collide and a cached file is only ever the bytes its manifest promised. A download is hashed as
it streams to a temporary file, checked (size, sha256, header) and only then renamed into place;
a size or checksum mismatch is retried with a fresh download (default 3 attempts) and then fails
with :class:`ShardChecksumError` (a dropped connection counts as a failed attempt too). A layout mismatch in the header is not retried: downloading the
same bytes again cannot fix it.
"""

from __future__ import annotations

import hashlib
import os
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, TypeVar

from services.loader.errors import ShardChecksumError
from services.loader.manifest import Manifest, ShardEntry
from services.loader.object_store import ObjectStore
from services.loader.verify import (
    read_manifest,
    verify_file,
    verify_model_file,
    verify_model_file_stream,
    verify_stream,
)

DEFAULT_ATTEMPTS = 3
CACHE_DIR_ENV = "SHARDLINE_SHARD_CACHE"
_C = TypeVar("_C")


def default_cache_dir() -> Path:
    """``$SHARDLINE_SHARD_CACHE``, else ``~/.cache/shardline/shards``."""
    return Path(os.environ.get(CACHE_DIR_ENV) or Path.home() / ".cache" / "shardline" / "shards")


@dataclass(frozen=True)
class StageResult:
    """Where the verified shard is, and how it got there (the fields of the Stage RPC's answer)."""

    local_path: Path
    sha256: str
    bytes: int
    cache_hit: bool
    attempts: int  # downloads made: 0 on a cache hit
    download_ns: int
    verify_ns: int


def cache_path(cache_dir: str | Path, entry: ShardEntry) -> Path:
    return Path(cache_dir) / entry.sha256 / entry.file


def _download_verified(store: ObjectStore, key: str, final: Path, verify: Callable[[BinaryIO, BinaryIO], _C], *,
                       attempts: int) -> tuple[_C, int]:
    """Download ``key`` to ``final`` through ``verify(stream, sink)``: into a private partial file,
    renamed into place only once verified. A checksum mismatch or a dropped connection is retried
    with a fresh download; returns the check and the attempts made."""
    if attempts < 1:
        raise ValueError(f"attempts must be >= 1, got {attempts}")
    final.parent.mkdir(parents=True, exist_ok=True)
    # unique per call: concurrent stagings of one file (threads of a server) never share a partial
    partial = final.with_name(f"{final.name}.partial-{uuid.uuid4().hex}")
    source = store.uri_for(key)
    failures: list[str] = []
    try:
        for attempt in range(1, attempts + 1):
            try:
                with store.open(key) as stream, open(partial, "wb") as sink:
                    check = verify(stream, sink)
            except ShardChecksumError as exc:
                failures.append(f"attempt {attempt}: {exc}")
                continue
            except store.transient_errors() as exc:
                failures.append(f"attempt {attempt}: {source}: download failed: {type(exc).__name__}: {exc}")
                continue
            os.replace(partial, final)
            return check, attempt
    finally:
        partial.unlink(missing_ok=True)
    raise ShardChecksumError(f"{source}: still wrong after {attempts} download attempt(s): "
                             + " | ".join(failures))


def stage_entry(manifest: Manifest, store: ObjectStore, entry: ShardEntry, cache_dir: str | Path, *,
                attempts: int = DEFAULT_ATTEMPTS) -> StageResult:
    """Stage ``entry`` of ``manifest`` from ``store`` (see :func:`stage`)."""
    if attempts < 1:
        raise ValueError(f"attempts must be >= 1, got {attempts}")
    final = cache_path(cache_dir, entry)
    if final.is_file():
        try:
            check = verify_file(final, manifest, entry)
            return StageResult(final, check.sha256, check.bytes, True, 0, 0, check.verify_ns)
        except ShardChecksumError:
            final.unlink(missing_ok=True)  # a damaged cache entry: download it again
    source = store.uri_for(entry.file)
    check, attempt = _download_verified(
        store, entry.file, final,
        lambda stream, sink: verify_stream(stream, manifest, entry, source=source, sink=sink), attempts=attempts)
    return StageResult(final, check.sha256, check.bytes, False, attempt, check.read_ns, check.check_ns)


def model_files_dir(cache_dir: str | Path, manifest: Manifest) -> Path:
    """``cache_dir/files-<digest>``: one directory per distinct set of model files, so the
    tokenizer loads from one place and two checkpoints' files never mix."""
    listing = "\n".join(f"{f.file}\0{f.sha256}" for f in sorted(manifest.model_files, key=lambda f: f.file))
    return Path(cache_dir) / f"files-{hashlib.sha256(listing.encode()).hexdigest()[:32]}"


def stage_model_files(manifest_uri: str | Path, *, cache_dir: str | Path | None = None,
                      attempts: int = DEFAULT_ATTEMPTS, endpoint_url: str | None = None,
                      store: ObjectStore | None = None) -> Path | None:
    """A local directory holding the checkpoint's model files (config.json, tokenizer.json,
    tokenizer_config.json, generation_config.json …), each verified against the manifest's sha256:
    what a worker given only a checkpoint tokenizes with. None when the manifest lists none
    (written before checkpoints carried them).

    A checkpoint in a local directory is verified in place and that directory returned, unless
    ``cache_dir`` is given; otherwise the files are downloaded (retried like shards) into
    :func:`model_files_dir` under ``cache_dir`` (default :func:`default_cache_dir`), and files
    already there and intact are not downloaded again.
    """
    manifest, store = read_manifest(manifest_uri, endpoint_url=endpoint_url, store=store)
    if not manifest.model_files:
        return None
    if cache_dir is None:
        in_place = [store.local_path(f.file) for f in manifest.model_files]
        if all(path is not None for path in in_place):
            for path, entry in zip(in_place, manifest.model_files, strict=True):
                verify_model_file(path, entry)
            return in_place[0].parent
    target = model_files_dir(cache_dir if cache_dir is not None else default_cache_dir(), manifest)
    for entry in manifest.model_files:
        final = target / entry.file
        if final.is_file():
            try:
                verify_model_file(final, entry)
                continue
            except ShardChecksumError:
                final.unlink(missing_ok=True)
        source = store.uri_for(entry.file)
        _download_verified(store, entry.file, final,
                           lambda stream, sink, entry=entry, source=source: verify_model_file_stream(
                               stream, entry, source=source, sink=sink), attempts=attempts)
    return target


def stage(manifest_uri: str | Path, tp_rank: int, pp_stage: int, *, cache_dir: str | Path | None = None,
          attempts: int = DEFAULT_ATTEMPTS, endpoint_url: str | None = None,
          store: ObjectStore | None = None) -> StageResult:
    """Download rank (tp_rank, pp_stage)'s shard of the checkpoint at ``manifest_uri`` into
    ``cache_dir`` (default :func:`default_cache_dir`), verify it against the manifest and return
    where it is. A shard already in the cache is re-hashed and returned without a download."""
    manifest, store = read_manifest(manifest_uri, endpoint_url=endpoint_url, store=store)
    entry = manifest.shard(tp_rank, pp_stage)
    return stage_entry(manifest, store, entry, cache_dir if cache_dir is not None else default_cache_dir(),
                       attempts=attempts)
