"""The checkpoint catalog: manifests validated where they are stored, recorded in the registry.

``register`` reads manifest.json at a URI and checks it before anything is recorded:

1. it parses and keeps its own invariants (:class:`~services.loader.manifest.Manifest`: plain
   shard names, one shard per rank, layer split, total bytes) — else INVALID_ARGUMENT;
2. its model config can be cut to its own plan, and every shard entry lists exactly the tensors
   that rank's model holds (built on ``meta`` from the manifest's config and plan) — else
   FAILED_PRECONDITION, naming the first difference;
3. every shard and model file it lists is in the store with the listed size — else NOT_FOUND
   (missing) or FAILED_PRECONDITION (size).

Hashing every byte is left to staging, which does it on the way onto a node anyway; registering
a 140 GB checkpoint reads one small file plus a HEAD per object.

The registry keeps the original columns (model name, dtype, shard URI prefix, total bytes, shard
count) plus the canonical manifest URI and degrees; a record is never patched, so registering the
same URI again returns the record (``created=False``) if it still describes the same checkpoint,
and refuses if the checkpoint at that URI has changed.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from services.common.errors import FailedPrecondition, InvalidArgument, NotFound, Unavailable
from services.common.registry import (
    CheckpointManifest,
    DuplicateManifest,
    ManifestNotFound,
    ShardRegistry,
    to_registry_dtype,
)
from services.common.registry.errors import as_client_errors
from services.loader.errors import ManifestError, ShardChecksumError
from services.loader.manifest import MANIFEST_NAME, Manifest
from services.loader.object_store import ObjectStore, open_store, split_object_uri
from services.loader.verify import check_entry_layout, check_plan


class ManifestNotRegistered(NotFound):
    """No manifest with that id or URI is recorded in the registry."""


class ManifestChanged(FailedPrecondition):
    """The manifest.json at a registered URI no longer describes what was recorded."""


@dataclass(frozen=True)
class Located:
    """A manifest.json as read from its store: the parsed manifest, its exact text, where it is."""

    manifest: Manifest
    manifest_json: str
    manifest_uri: str  # canonical: an absolute path or s3://bucket/prefix/manifest.json
    store: ObjectStore


@dataclass(frozen=True)
class CatalogEntry:
    """A recorded manifest; ``located`` is None only for records made without a manifest URI."""

    record: CheckpointManifest
    located: Located | None
    created: bool = False


def canonical_manifest_uri(manifest_uri: str | Path, *, endpoint_url: str | None = None) -> tuple[str, ObjectStore]:
    """The one spelling of a manifest URI the registry keys on (``ckpt``, ``ckpt/`` and
    ``./ckpt/manifest.json`` are the same checkpoint), with the store its shards live in."""
    text = str(manifest_uri).strip()
    if not text:
        raise InvalidArgument("manifest_uri is empty: expected a manifest.json path, its directory, or "
                              "s3://bucket/prefix/manifest.json")
    root, name = split_object_uri(text, default_name=MANIFEST_NAME)
    store = open_store(root, endpoint_url=endpoint_url)
    return store.uri_for(name), store


def locate(manifest_uri: str | Path, *, endpoint_url: str | None = None) -> Located:
    """Read and parse manifest.json at ``manifest_uri`` (no registry involved)."""
    uri, store = canonical_manifest_uri(manifest_uri, endpoint_url=endpoint_url)
    name = uri.rpartition("/")[2]
    with _store_errors(store, uri):
        raw = store.read_bytes(name)
    manifest = Manifest.from_json(raw, source=uri)
    return Located(manifest, raw.decode(), uri, store)


def check_checkpoint(located: Located) -> None:
    """Steps 2 and 3 of registration (see the module docstring); raises on the first problem."""
    # deferred: torch (the rank models on meta): a loader never asked to register never imports it
    from services.loader.layout import RankLayout
    from services.modeling.config import ModelConfig, ModelConfigError
    from services.modeling.parallel.plan import ParallelPlan

    manifest, store, uri = located.manifest, located.store, located.manifest_uri
    try:
        config = ModelConfig.from_dict(manifest.model_config, name=manifest.model_name)
        plan = ParallelPlan(config, manifest.plan.tp_degree, manifest.plan.pp_degree, manifest.plan.dtype)
    except (ModelConfigError, KeyError, TypeError) as exc:
        raise ManifestError(f"{uri}: its model config cannot be cut to its own plan "
                            f"({manifest.plan.describe()}): {exc}") from None
    check_plan(manifest, plan, source=uri)
    for entry in sorted(manifest.shards, key=lambda e: (e.pp_stage, e.tp_rank)):
        layout = RankLayout.for_rank(plan, plan.rank_of(entry.pp_stage, entry.tp_rank))
        check_entry_layout(entry, layout, source=store.uri_for(entry.file))
    listed = [(e.file, e.bytes) for e in manifest.shards] + [(f.file, f.bytes) for f in manifest.model_files]
    with _store_errors(store, uri):
        for file, nbytes in listed:
            size = store.size(file)  # ObjectNotFound (NOT_FOUND) names the missing object
            if size != nbytes:
                raise ShardChecksumError(f"{store.uri_for(file)}: {size} bytes, the manifest at {uri} says {nbytes}")


def _same_checkpoint(record: CheckpointManifest, located: Located) -> list[str]:
    """Differences between a registry record and the manifest now at its URI ([] when equal)."""
    m = located.manifest
    want = {"model_name": m.model_name, "dtype": to_registry_dtype(m.dtype),
            "shard_uri_prefix": located.store.uri, "total_bytes": m.total_bytes, "shard_count": len(m.shards),
            "tp_degree": m.plan.tp_degree, "pp_degree": m.plan.pp_degree}
    return [f"{key}: recorded {getattr(record, key)!r}, manifest now says {value!r}"
            for key, value in want.items() if getattr(record, key) != value]


@contextmanager
def _store_errors(store: ObjectStore, uri: str) -> Iterator[None]:
    try:
        yield
    except store.transient_errors() as exc:
        raise Unavailable(f"{uri}: object store unreachable: {type(exc).__name__}: {exc}") from exc


class ManifestCatalog:
    """Checkpoint manifests on top of a :class:`ShardRegistry` (PostgreSQL or SQLite)."""

    def __init__(self, registry: ShardRegistry, *, endpoint_url: str | None = None) -> None:
        self.registry = registry
        self.endpoint_url = endpoint_url

    def register(self, manifest_uri: str | Path) -> CatalogEntry:
        """Validate the checkpoint at ``manifest_uri`` and record it (idempotent per URI)."""
        located = locate(manifest_uri, endpoint_url=self.endpoint_url)
        check_checkpoint(located)
        m = located.manifest
        with as_client_errors(translate={ManifestNotFound: ManifestNotRegistered}):
            try:
                existing = self.registry.get_manifest_by_uri(located.manifest_uri)
            except ManifestNotFound:
                existing = None
            if existing is None:
                try:
                    record = self.registry.register_manifest(
                        m.model_name, m.dtype, located.store.uri, m.total_bytes, len(m.shards),
                        manifest_uri=located.manifest_uri, tp_degree=m.plan.tp_degree,
                        pp_degree=m.plan.pp_degree)
                    return CatalogEntry(record, located, created=True)
                except DuplicateManifest:  # a concurrent registration of the same URI won the race
                    existing = self.registry.get_manifest_by_uri(located.manifest_uri)
        diffs = _same_checkpoint(existing, located)
        if diffs:
            raise ManifestChanged(f"{located.manifest_uri} is already registered as manifest "
                                  f"{existing.manifest_id} for another checkpoint ({'; '.join(diffs)}); "
                                  "records are never patched: write the new checkpoint under a new URI")
        return CatalogEntry(existing, located, created=False)

    def get(self, *, manifest_id: str | uuid.UUID | None = None,
            manifest_uri: str | Path | None = None) -> CatalogEntry:
        """A recorded manifest by registry id or by URI, with the manifest re-read from its store
        (and refused if it no longer matches the record)."""
        if (manifest_id is None) == (manifest_uri is None):
            raise InvalidArgument("give exactly one of manifest_id and manifest_uri")
        with as_client_errors(translate={ManifestNotFound: ManifestNotRegistered}):
            if manifest_id is not None:
                record = self.registry.get_manifest(manifest_id)
            else:
                uri, _ = canonical_manifest_uri(manifest_uri, endpoint_url=self.endpoint_url)
                record = self.registry.get_manifest_by_uri(uri)
        if record.manifest_uri is None:
            return CatalogEntry(record, None)
        located = locate(record.manifest_uri, endpoint_url=self.endpoint_url)
        diffs = _same_checkpoint(record, located)
        if diffs:
            raise ManifestChanged(f"{record.manifest_uri} changed since it was registered as manifest "
                                  f"{record.manifest_id}: {'; '.join(diffs)}")
        return CatalogEntry(record, located)

    def list(self, model_name: str | None = None, dtype: str | None = None) -> list[CheckpointManifest]:
        """Recorded manifests, newest first; ``None`` filters nothing."""
        with as_client_errors(translate={ManifestNotFound: ManifestNotRegistered}):
            return self.registry.list_manifests(model_name=model_name or None, dtype=dtype or None)
