"""WorkerService: token streaming, scoring, KV stats and draining for one replica group.

Served by the group's driver (global rank 0). A thin servicer: protobuf in, a call into the
engine, protobuf out; domain errors become statuses in ``services.common.grpc_server``. Until
issue 4 puts the serving engine behind it, every RPC answers UNIMPLEMENTED naming that issue.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator

import grpc

from services.common.grpc_server import ServiceBinding, serve_service, unimplemented
from services.common.proto import worker_pb2, worker_pb2_grpc

SERVICE = "worker"
BUILT_BY_ISSUE = 4


class WorkerServicer(worker_pb2_grpc.WorkerServiceServicer):
    """gRPC face of a replica group's engine."""

    def Generate(
        self, request: worker_pb2.GenerateRequest, context: grpc.ServicerContext
    ) -> Iterator[worker_pb2.GenerateResponse]:
        unimplemented(context, "WorkerService.Generate", BUILT_BY_ISSUE)

    def Score(self, request: worker_pb2.ScoreRequest, context: grpc.ServicerContext) -> worker_pb2.ScoreResponse:
        unimplemented(context, "WorkerService.Score", BUILT_BY_ISSUE)

    def Stats(self, request: worker_pb2.StatsRequest, context: grpc.ServicerContext) -> worker_pb2.StatsResponse:
        unimplemented(context, "WorkerService.Stats", BUILT_BY_ISSUE)

    def Drain(self, request: worker_pb2.DrainRequest, context: grpc.ServicerContext) -> worker_pb2.DrainResponse:
        unimplemented(context, "WorkerService.Drain", BUILT_BY_ISSUE)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Worker-specific flags (the common server flags are added by the caller). Issue 4 adds
    --model, --tp, --pp, --dtype here; issue 5 adds --checkpoint."""


def bindings(args: argparse.Namespace) -> list[ServiceBinding]:
    return [
        ServiceBinding(
            full_name=worker_pb2.DESCRIPTOR.services_by_name["WorkerService"].full_name,
            servicer=WorkerServicer(),
            add_to_server=worker_pb2_grpc.add_WorkerServiceServicer_to_server,
        )
    ]


def serve(args: argparse.Namespace) -> int:
    return serve_service(args, service=SERVICE, bindings=lambda: bindings(args))
