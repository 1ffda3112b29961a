"""TelemetryService: CollectiveEvent ingest, windowed percentiles and alerts over gRPC.

A thin servicer: protobuf in, a call into the telemetry domain modules (windows, rules,
exporters), protobuf out; domain errors become statuses in ``services.common.grpc_server``.
Until issue 8 builds those, every RPC answers UNIMPLEMENTED naming that issue.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator

import grpc

from services.common.grpc_server import ServiceBinding, serve_service, unimplemented
from services.common.proto import telemetry_pb2, telemetry_pb2_grpc

SERVICE = "telemetry"
BUILT_BY_ISSUE = 8


class TelemetryServicer(telemetry_pb2_grpc.TelemetryServiceServicer):
    """gRPC face of the telemetry pipeline."""

    def Report(
        self, request_iterator: Iterator[telemetry_pb2.ReportRequest], context: grpc.ServicerContext
    ) -> telemetry_pb2.ReportResponse:
        unimplemented(context, "TelemetryService.Report", BUILT_BY_ISSUE)

    def Query(
        self, request: telemetry_pb2.QueryRequest, context: grpc.ServicerContext
    ) -> telemetry_pb2.QueryResponse:
        unimplemented(context, "TelemetryService.Query", BUILT_BY_ISSUE)

    def Alerts(
        self, request: telemetry_pb2.AlertsRequest, context: grpc.ServicerContext
    ) -> Iterator[telemetry_pb2.Alert]:
        unimplemented(context, "TelemetryService.Alerts", BUILT_BY_ISSUE)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Telemetry-specific flags (the common server flags are added by the caller). Issue 8 adds
    --metrics-port, the window and alert-rule settings here."""


def bindings(args: argparse.Namespace) -> list[ServiceBinding]:
    return [
        ServiceBinding(
            full_name=telemetry_pb2.DESCRIPTOR.services_by_name["TelemetryService"].full_name,
            servicer=TelemetryServicer(),
            add_to_server=telemetry_pb2_grpc.add_TelemetryServiceServicer_to_server,
        )
    ]


def serve(args: argparse.Namespace) -> int:
    return serve_service(args, service=SERVICE, bindings=lambda: bindings(args))
