"""RouterService: the client-facing front door (admission, KV-headroom routing, streaming).

A thin servicer: protobuf in, a call into the router's domain modules, protobuf out; domain
errors become statuses in ``services.common.grpc_server``. Until issue 7 builds routing and
admission, every RPC answers UNIMPLEMENTED naming that issue.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator

import grpc

from services.common.grpc_server import ServiceBinding, serve_service, unimplemented
from services.common.proto import router_pb2, router_pb2_grpc

SERVICE = "router"
BUILT_BY_ISSUE = 7


class RouterServicer(router_pb2_grpc.RouterServiceServicer):
    """gRPC face of the router."""

    def Generate(
        self, request: router_pb2.RouterGenerateRequest, context: grpc.ServicerContext
    ) -> Iterator[router_pb2.RouterGenerateResponse]:
        unimplemented(context, "RouterService.Generate", BUILT_BY_ISSUE)

    def ListModels(
        self, request: router_pb2.ListModelsRequest, context: grpc.ServicerContext
    ) -> router_pb2.ListModelsResponse:
        unimplemented(context, "RouterService.ListModels", BUILT_BY_ISSUE)

    def ListReplicaGroups(
        self, request: router_pb2.ListReplicaGroupsRequest, context: grpc.ServicerContext
    ) -> router_pb2.ListReplicaGroupsResponse:
        unimplemented(context, "RouterService.ListReplicaGroups", BUILT_BY_ISSUE)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Router-specific flags (the common server flags are added by the caller). Issue 7 adds
    --http-port, --api-key and the queue settings here."""


def bindings(args: argparse.Namespace) -> list[ServiceBinding]:
    return [
        ServiceBinding(
            full_name=router_pb2.DESCRIPTOR.services_by_name["RouterService"].full_name,
            servicer=RouterServicer(),
            add_to_server=router_pb2_grpc.add_RouterServiceServicer_to_server,
        )
    ]


def serve(args: argparse.Namespace) -> int:
    return serve_service(args, service=SERVICE, bindings=lambda: bindings(args))
