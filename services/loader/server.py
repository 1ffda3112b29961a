"""LoaderService: checkpoint manifests and verified shard staging over gRPC.

A thin servicer: protobuf in, a call into the loader's domain modules (``catalog`` for the
registry side, ``staging`` for the node-local cache), protobuf out; domain errors become statuses
in ``services.common.grpc_server``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import grpc
from sqlalchemy.exc import SQLAlchemyError

from services.common.config import resolve
from services.common.errors import InvalidArgument
from services.common.grpc_server import ServiceBinding, serve_service
from services.common.proto import common_pb2, loader_pb2, loader_pb2_grpc
from services.common.proto_convert import DTYPE_FROM_PB, dtype_to_pb
from services.common.registry import CheckpointManifest, RegistryError, ShardRegistry, registry_url, to_project_dtype
from services.loader.catalog import CatalogEntry, ManifestCatalog, canonical_manifest_uri
from services.loader.staging import CACHE_DIR_ENV, default_cache_dir, stage

SERVICE = "loader"



def summary_to_pb(record: CheckpointManifest, fingerprint: str = "") -> loader_pb2.ManifestSummary:
    return loader_pb2.ManifestSummary(
        manifest_id=str(record.manifest_id), model_name=record.model_name,
        manifest_uri=record.manifest_uri or "", shard_uri_prefix=record.shard_uri_prefix,
        layout=common_pb2.ShardLayout(tp_degree=record.tp_degree or 0, pp_degree=record.pp_degree or 0,
                                      dtype=dtype_to_pb(to_project_dtype(record.dtype))),
        total_bytes=record.total_bytes, shard_count=record.shard_count, model_fingerprint=fingerprint,
        created_at_ms=int(record.created_at.timestamp() * 1000))


def entry_summary_to_pb(entry: CatalogEntry) -> loader_pb2.ManifestSummary:
    fingerprint = entry.located.manifest.model_fingerprint if entry.located is not None else ""
    return summary_to_pb(entry.record, fingerprint)


class LoaderServicer(loader_pb2_grpc.LoaderServiceServicer):
    """gRPC face of the loader: the manifest catalog and the node-local shard cache."""

    def __init__(self, catalog: ManifestCatalog, cache_dir: Path, *, endpoint_url: str | None = None) -> None:
        self.catalog = catalog
        self.cache_dir = cache_dir
        self.endpoint_url = endpoint_url

    def RegisterManifest(
        self, request: loader_pb2.RegisterManifestRequest, context: grpc.ServicerContext
    ) -> loader_pb2.RegisterManifestResponse:
        entry = self.catalog.register(request.manifest_uri)
        return loader_pb2.RegisterManifestResponse(manifest=entry_summary_to_pb(entry), created=entry.created)

    def GetManifest(
        self, request: loader_pb2.GetManifestRequest, context: grpc.ServicerContext
    ) -> loader_pb2.GetManifestResponse:
        key = request.WhichOneof("key")
        if key is None:
            raise InvalidArgument("GetManifest needs manifest_id or manifest_uri")
        entry = self.catalog.get(**{key: getattr(request, key)})
        response = loader_pb2.GetManifestResponse(manifest=entry_summary_to_pb(entry))
        if entry.located is not None:
            manifest = entry.located.manifest
            response.manifest_json = entry.located.manifest_json
            response.shards.extend(
                loader_pb2.ShardEntry(file_name=s.file, tp_rank=s.tp_rank, pp_stage=s.pp_stage,
                                      layer_start=s.layer_start, layer_end=s.layer_end, bytes=s.bytes,
                                      sha256=s.sha256, tensor_count=len(s.tensors))
                for s in sorted(manifest.shards, key=lambda s: (s.pp_stage, s.tp_rank)))
            response.model_files.extend(loader_pb2.ModelFileEntry(file_name=f.file, bytes=f.bytes, sha256=f.sha256)
                                        for f in manifest.model_files)
        return response

    def ListManifests(
        self, request: loader_pb2.ListManifestsRequest, context: grpc.ServicerContext
    ) -> loader_pb2.ListManifestsResponse:
        if request.dtype != common_pb2.DTYPE_UNSPECIFIED and request.dtype not in DTYPE_FROM_PB:
            raise InvalidArgument(f"unknown dtype enum value {request.dtype}")
        records = self.catalog.list(model_name=request.model_name or None,
                                    dtype=DTYPE_FROM_PB.get(request.dtype))
        return loader_pb2.ListManifestsResponse(manifests=[summary_to_pb(r) for r in records])

    def Stage(self, request: loader_pb2.StageRequest, context: grpc.ServicerContext) -> loader_pb2.StageResponse:
        uri, store = canonical_manifest_uri(request.manifest_uri, endpoint_url=self.endpoint_url)
        result = stage(uri, request.tp_rank, request.pp_stage, cache_dir=self.cache_dir, store=store)
        return loader_pb2.StageResponse(
            local_path=str(result.local_path.resolve()), sha256=result.sha256, bytes=result.bytes,
            cache_hit=result.cache_hit, attempts=result.attempts, download_ns=result.download_ns,
            verify_ns=result.verify_ns)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Loader-specific flags (the common server flags are added by the caller)."""
    parser.add_argument("--registry-url", default=None,
                        help="shard registry URL, postgresql+psycopg://... or sqlite:///PATH (env "
                             "SHARDLINE_REGISTRY_URL; default sqlite:///$SHARDLINE_STATE_DIR/registry.db)")
    parser.add_argument("--cache-dir", type=Path, default=None,
                        help=f"node-local directory shards are staged into (env {CACHE_DIR_ENV}; "
                             "default ~/.cache/shardline/shards)")
    parser.add_argument("--s3-endpoint-url", default=None,
                        help="S3-compatible endpoint for s3:// checkpoints (env SHARDLINE_S3_ENDPOINT_URL; "
                             "default: AWS)")


def build_servicer(args: argparse.Namespace) -> LoaderServicer:
    """The servicer from flags, then SHARDLINE_* env, then defaults; migrates the registry schema."""
    endpoint_url = resolve("s3_endpoint_url", args.s3_endpoint_url, "") or None
    cache_dir = Path(resolve("shard_cache", args.cache_dir, default_cache_dir(), cast=Path)).expanduser()
    registry = ShardRegistry(registry_url(args.registry_url), migrate_schema=True)
    return LoaderServicer(ManifestCatalog(registry, endpoint_url=endpoint_url), cache_dir, endpoint_url=endpoint_url)


def bindings(servicer: LoaderServicer) -> list[ServiceBinding]:
    return [
        ServiceBinding(
            full_name=loader_pb2.DESCRIPTOR.services_by_name["LoaderService"].full_name,
            servicer=servicer,
            add_to_server=loader_pb2_grpc.add_LoaderServiceServicer_to_server,
        )
    ]


def serve(args: argparse.Namespace) -> int:
    try:
        servicer = build_servicer(args)
    except (RegistryError, SQLAlchemyError, InvalidArgument) as exc:
        print(f"shardline serve {SERVICE}: {exc}", file=sys.stderr)
        return 2
    try:
        return serve_service(args, service=SERVICE, bindings=lambda: bindings(servicer))
    finally:
        servicer.catalog.registry.close()
