"""Stage one rank's shard into a node-local cache, verified; a second call is a verified cache hit.

The cache is content-addressed: ``cache_dir/<sha256>/<file>``, so two checkpoints can never
collide and a cached file is only ever the bytes its manifest promised. A download is hashed as
it streams to a temporary file, checked (size, sha256, header) and only then renamed into place;
a size or checksum mismatch is retried with a fresh download (default 3 attempts) and then fails
with :class:`ShardChecksumError` (a dropped connection counts as a failed attempt too). A layout mismatch in the header is not retried: downloading the
same bytes again cannot fix it.
"""

from __future__ import annotations

import os
import uuid
from dataclasses import dataclass
from pathlib import Path

from services.loader.errors import ShardChecksumError
from services.loader.manifest import Manifest, ShardEntry
from services.loader.object_store import ObjectStore
from services.loader.verify import read_manifest, verify_file, verify_stream

DEFAULT_ATTEMPTS = 3
CACHE_DIR_ENV = "SHARDLINE_SHARD_CACHE"


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
    final.parent.mkdir(parents=True, exist_ok=True)
    # unique per call: concurrent stagings of one shard (threads of a server) never share a file
    partial = final.with_name(f"{final.name}.partial-{uuid.uuid4().hex}")
    source = store.uri_for(entry.file)
    failures: list[str] = []
    try:
        for attempt in range(1, attempts + 1):
            try:
                with store.open(entry.file) as stream, open(partial, "wb") as sink:
                    check = verify_stream(stream, manifest, entry, source=source, sink=sink)
            except ShardChecksumError as exc:
                failures.append(f"attempt {attempt}: {exc}")
                continue
            except store.transient_errors() as exc:
                failures.append(f"attempt {attempt}: {source}: download failed: {type(exc).__name__}: {exc}")
                continue
            os.replace(partial, final)
            return StageResult(final, check.sha256, check.bytes, False, attempt, check.read_ns, check.check_ns)
    finally:
        partial.unlink(missing_ok=True)
    raise ShardChecksumError(f"{source}: still wrong after {attempts} download attempt(s): "
                             + " | ".join(failures))


def stage(manifest_uri: str | Path, tp_rank: int, pp_stage: int, cache_dir: str | Path | None = None, *,
          attempts: int = DEFAULT_ATTEMPTS, endpoint_url: str | None = None,
          store: ObjectStore | None = None) -> StageResult:
    """Download rank (tp_rank, pp_stage)'s shard of the checkpoint at ``manifest_uri`` into
    ``cache_dir`` (default :func:`default_cache_dir`), verify it against the manifest and return
    where it is. A shard already in the cache is re-hashed and returned without a download."""
    manifest, store = read_manifest(manifest_uri, endpoint_url=endpoint_url, store=store)
    entry = manifest.shard(tp_rank, pp_stage)
    return stage_entry(manifest, store, entry, cache_dir if cache_dir is not None else default_cache_dir(),
                       attempts=attempts)
