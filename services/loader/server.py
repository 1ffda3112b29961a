"""LoaderService: checkpoint manifests and verified shard staging over gRPC.

A thin servicer: protobuf in, a call into the loader's domain modules (manifest, object store,
verify/stage), protobuf out; domain errors become statuses in ``services.common.grpc_server``.
Until issue 5 builds those, every RPC answers UNIMPLEMENTED naming that issue.
"""

from __future__ import annotations

import argparse

import grpc

from services.common.grpc_server import ServiceBinding, serve_service, unimplemented
from services.common.proto import loader_pb2, loader_pb2_grpc

SERVICE = "loader"
BUILT_BY_ISSUE = 5


class LoaderServicer(loader_pb2_grpc.LoaderServiceServicer):
    """gRPC face of the loader."""

    def RegisterManifest(
        self, request: loader_pb2.RegisterManifestRequest, context: grpc.ServicerContext
    ) -> loader_pb2.RegisterManifestResponse:
        unimplemented(context, "LoaderService.RegisterManifest", BUILT_BY_ISSUE)

    def GetManifest(
        self, request: loader_pb2.GetManifestRequest, context: grpc.ServicerContext
    ) -> loader_pb2.GetManifestResponse:
        unimplemented(context, "LoaderService.GetManifest", BUILT_BY_ISSUE)

    def ListManifests(
        self, request: loader_pb2.ListManifestsRequest, context: grpc.ServicerContext
    ) -> loader_pb2.ListManifestsResponse:
        unimplemented(context, "LoaderService.ListManifests", BUILT_BY_ISSUE)

    def Stage(self, request: loader_pb2.StageRequest, context: grpc.ServicerContext) -> loader_pb2.StageResponse:
        unimplemented(context, "LoaderService.Stage", BUILT_BY_ISSUE)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Loader-specific flags (the common server flags are added by the caller)."""


def bindings(args: argparse.Namespace) -> list[ServiceBinding]:
    return [
        ServiceBinding(
            full_name=loader_pb2.DESCRIPTOR.services_by_name["LoaderService"].full_name,
            servicer=LoaderServicer(),
            add_to_server=loader_pb2_grpc.add_LoaderServiceServicer_to_server,
        )
    ]


def serve(args: argparse.Namespace) -> int:
    return serve_service(args, service=SERVICE, bindings=lambda: bindings(args))
