"""PlannerService: shard plans, their explanation and capacity sizing over gRPC.

A thin servicer: protobuf in, a call into the planner's domain modules, protobuf out; domain
errors become statuses in ``services.common.grpc_server``. Until issue 6 wires the cost model
and search in, every RPC answers UNIMPLEMENTED naming that issue.
"""

from __future__ import annotations

import argparse

import grpc

from services.common.grpc_server import ServiceBinding, serve_service, unimplemented
from services.common.proto import planner_pb2, planner_pb2_grpc

SERVICE = "planner"
BUILT_BY_ISSUE = 6


class PlannerServicer(planner_pb2_grpc.PlannerServiceServicer):
    """gRPC face of the planner."""

    def Plan(self, request: planner_pb2.PlanRequest, context: grpc.ServicerContext) -> planner_pb2.PlanResponse:
        unimplemented(context, "PlannerService.Plan", BUILT_BY_ISSUE)

    def Explain(
        self, request: planner_pb2.ExplainRequest, context: grpc.ServicerContext
    ) -> planner_pb2.ExplainResponse:
        unimplemented(context, "PlannerService.Explain", BUILT_BY_ISSUE)

    def Capacity(
        self, request: planner_pb2.CapacityRequest, context: grpc.ServicerContext
    ) -> planner_pb2.CapacityResponse:
        unimplemented(context, "PlannerService.Capacity", BUILT_BY_ISSUE)

    def RecordPlan(
        self, request: planner_pb2.RecordPlanRequest, context: grpc.ServicerContext
    ) -> planner_pb2.RecordPlanResponse:
        unimplemented(context, "PlannerService.RecordPlan", BUILT_BY_ISSUE)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Planner-specific flags (the common server flags are added by the caller)."""


def bindings(args: argparse.Namespace) -> list[ServiceBinding]:
    return [
        ServiceBinding(
            full_name=planner_pb2.DESCRIPTOR.services_by_name["PlannerService"].full_name,
            servicer=PlannerServicer(),
            add_to_server=planner_pb2_grpc.add_PlannerServiceServicer_to_server,
        )
    ]


def serve(args: argparse.Namespace) -> int:
    return serve_service(args, service=SERVICE, bindings=lambda: bindings(args))
