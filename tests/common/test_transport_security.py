"""Transport security on real gRPC servers over loopback: TLS, mutual TLS, the internal token,
reflection off outside --dev, and an HTTPS /metrics behind the token."""

from __future__ import annotations

import asyncio
import ssl
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from services.common.bearer_auth import BearerCheck
from services.common.config import ServerConfig
from services.common.errors import InvalidArgument
from services.common.grpc_server import GrpcServer, ServiceBinding, start_server
from services.common.metrics_http import MetricsHttpServer
from services.common.proto import planner_pb2, planner_pb2_grpc
from services.common.transport_security import TOKEN_METADATA_KEY, TransportSecurity, open_aio_channel, open_channel
from services.planner.record import PlanRecorder
from services.planner.server import PlannerServicer
from tests.certs import Pki, make_pki

TOKEN = "s3cret-internal"


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


def _planner(security: TransportSecurity, tmp_path: Path, *, service: str = "planner",
             reflection: bool = False) -> GrpcServer:
    binding = ServiceBinding(full_name=planner_pb2.DESCRIPTOR.services_by_name["PlannerService"].full_name,
                             servicer=PlannerServicer(PlanRecorder(f"sqlite:///{tmp_path / 'registry.db'}")),
                             add_to_server=planner_pb2_grpc.add_PlannerServiceServicer_to_server)
    return start_server(ServerConfig(service=service, port=0, reflection=reflection), [binding], security=security)


@pytest.fixture
def servers() -> Iterator[list[GrpcServer]]:
    started: list[GrpcServer] = []
    yield started
    for server in started:
        server.stop(0)


def _plan_code(channel: grpc.Channel, metadata: tuple[tuple[str, str], ...] = ()) -> grpc.StatusCode:
    """The status of an empty Plan request: INVALID_ARGUMENT once it reached the planner."""
    try:
        planner_pb2_grpc.PlannerServiceStub(channel).Plan(planner_pb2.PlanRequest(), timeout=10, metadata=metadata)
    except grpc.RpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


def _health(channel: grpc.Channel) -> str:
    response = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
    return health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)


def test_internal_token_required_except_for_health(servers: list[GrpcServer], tmp_path: Path) -> None:
    servers.append(server := _planner(TransportSecurity(internal_token=TOKEN), tmp_path))
    with grpc.insecure_channel(server.address) as plain:
        assert _plan_code(plain) == grpc.StatusCode.UNAUTHENTICATED
        assert _plan_code(plain, ((TOKEN_METADATA_KEY, "wrong"),)) == grpc.StatusCode.UNAUTHENTICATED
        assert _plan_code(plain, ((TOKEN_METADATA_KEY, TOKEN),)) == grpc.StatusCode.INVALID_ARGUMENT
        assert _health(plain) == "SERVING"  # probes carry no secret
    with open_channel(server.address, TransportSecurity(internal_token=TOKEN)) as channel:
        assert _plan_code(channel) == grpc.StatusCode.INVALID_ARGUMENT


def test_the_router_never_asks_for_the_internal_token(servers: list[GrpcServer], tmp_path: Path) -> None:
    assert TransportSecurity(internal_token=TOKEN).required_token("router") is None
    assert TransportSecurity(internal_token=TOKEN).required_token("worker") == TOKEN


def test_tls_serves_only_to_clients_that_verify_it(servers: list[GrpcServer], tmp_path: Path, pki: Pki) -> None:
    servers.append(server := _planner(TransportSecurity(cert_file=str(pki.cert), key_file=str(pki.key)), tmp_path))
    with open_channel(server.address, TransportSecurity(ca_file=str(pki.ca))) as channel:
        assert _plan_code(channel) == grpc.StatusCode.INVALID_ARGUMENT
    with grpc.insecure_channel(server.address) as plain:
        assert _plan_code(plain) == grpc.StatusCode.UNAVAILABLE
    with open_channel(server.address, TransportSecurity(ca_file=str(pki.other_ca))) as untrusted:
        assert _plan_code(untrusted) == grpc.StatusCode.UNAVAILABLE


def test_mutual_tls_refuses_a_client_without_a_certificate(servers: list[GrpcServer], tmp_path: Path,
                                                            pki: Pki) -> None:
    mtls = TransportSecurity(cert_file=str(pki.cert), key_file=str(pki.key), ca_file=str(pki.ca), mtls=True)
    servers.append(server := _planner(mtls, tmp_path))
    with open_channel(server.address, mtls) as channel:
        assert _plan_code(channel) == grpc.StatusCode.INVALID_ARGUMENT
    with open_channel(server.address, TransportSecurity(ca_file=str(pki.ca))) as anonymous:
        assert _plan_code(anonymous) == grpc.StatusCode.UNAVAILABLE


def _list_services(channel: grpc.Channel) -> grpc.StatusCode | list[str]:
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    try:
        responses = list(stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]),
                                                   timeout=10))
    except grpc.RpcError as exc:
        return exc.code()
    return [s.name for s in responses[0].list_services_response.service]


def test_reflection_only_in_dev(servers: list[GrpcServer], tmp_path: Path) -> None:
    servers.append(quiet := _planner(TransportSecurity(), tmp_path))
    servers.append(dev := _planner(TransportSecurity(), tmp_path, reflection=True))
    with grpc.insecure_channel(quiet.address) as channel:
        assert _list_services(channel) == grpc.StatusCode.UNIMPLEMENTED
    with grpc.insecure_channel(dev.address) as channel:
        assert "shardline.v1.PlannerService" in _list_services(channel)


def test_settings_are_checked_before_anything_starts(pki: Pki, tmp_path: Path) -> None:
    with pytest.raises(InvalidArgument, match="go together"):
        TransportSecurity(cert_file=str(pki.cert))
    with pytest.raises(InvalidArgument, match="needs --tls-ca"):
        TransportSecurity(cert_file=str(pki.cert), key_file=str(pki.key), mtls=True)
    with pytest.raises(InvalidArgument, match="no such file"):
        TransportSecurity(ca_file=str(tmp_path / "missing.pem"))
    env = {"SHARDLINE_TLS_CA": str(pki.ca), "SHARDLINE_INTERNAL_TOKEN": TOKEN}
    assert TransportSecurity.from_args(environ=env) == TransportSecurity(ca_file=str(pki.ca), internal_token=TOKEN)
    assert TransportSecurity.from_args(environ=TransportSecurity.from_args(environ=env).environ()) == \
        TransportSecurity.from_args(environ=env)


def test_metrics_over_https_behind_the_token(pki: Pki) -> None:
    server_side = TransportSecurity(cert_file=str(pki.cert), key_file=str(pki.key), internal_token=TOKEN)
    server = MetricsHttpServer(0, auth=BearerCheck(TOKEN, what="internal token"),
                               ssl_context=server_side.server_ssl_context())
    url = f"https://127.0.0.1:{server.server_port}/metrics"
    scraper = TransportSecurity(ca_file=str(pki.ca), internal_token=TOKEN)
    try:
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(url, context=scraper.client_ssl_context(), timeout=10)
        assert refused.value.code == 401
        request = urllib.request.Request(url, headers=scraper.http_headers())
        with urllib.request.urlopen(request, context=scraper.client_ssl_context(), timeout=10) as response:
            assert response.status == 200 and b"python_info" in response.read()
        with pytest.raises(urllib.error.URLError) as unverified:
            urllib.request.urlopen(request, context=ssl.create_default_context(), timeout=10)
        assert isinstance(unverified.value.reason, ssl.SSLCertVerificationError)
    finally:
        server.shutdown()


def test_asyncio_channels_carry_the_token_on_every_kind_of_call(servers: list[GrpcServer], tmp_path: Path) -> None:
    """The router's Relay is a bidirectional stream on a grpc.aio channel."""
    servers.append(server := _planner(TransportSecurity(internal_token=TOKEN), tmp_path, reflection=True))

    async def calls(security: TransportSecurity) -> tuple[grpc.StatusCode, grpc.StatusCode]:
        async with open_aio_channel(server.address, security) as channel:
            async def one_request():
                yield reflection_pb2.ServerReflectionRequest(list_services="")

            try:
                async for _response in reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(
                        one_request(), timeout=10):
                    pass
                stream = grpc.StatusCode.OK
            except grpc.RpcError as exc:
                stream = exc.code()
            try:
                await planner_pb2_grpc.PlannerServiceStub(channel).Plan(planner_pb2.PlanRequest(), timeout=10)
                unary = grpc.StatusCode.OK
            except grpc.RpcError as exc:
                unary = exc.code()
        return stream, unary

    assert asyncio.run(calls(TransportSecurity(internal_token=TOKEN))) == \
        (grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT)
    assert asyncio.run(calls(TransportSecurity())) == \
        (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.UNAUTHENTICATED)
