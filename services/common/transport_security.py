"""Transport security for every port a shardline process opens: TLS, mutual TLS, the internal token.

Three settings, each off by default (a stack on loopback needs none of them), each a flag with
a ``SHARDLINE_*`` environment variable, read the same way by every service and client:

- **TLS** (``--tls-cert``/``--tls-key``, PEM files): the process serves its gRPC port (and the
  router its HTTP port, and any ``--metrics-port``) over TLS only. A client verifies the server
  against ``--tls-ca``; with no CA it connects in plaintext, so a TLS stack sets the CA everywhere.
- **mutual TLS** (``--mtls``): the internal services (worker, planner, loader, telemetry) accept
  only clients presenting a certificate signed by ``--tls-ca``. A client presents its own
  ``--tls-cert`` when it has one. The router's public ports never ask for client certificates:
  its callers prove themselves with the API key.
- **the internal token** (``--internal-token``, better given as ``SHARDLINE_INTERNAL_TOKEN`` so it
  stays out of ``ps``): the internal services refuse every RPC without the metadata
  ``x-shardline-internal-token: <token>`` with UNAUTHENTICATED, so only the router and the
  control plane (``shardline`` commands with the same setting) can call a worker. The standard
  health service stays open, so probes work without the secret. Over a network the token
  travels under TLS.

Where it is used: :mod:`services.common.grpc_server` and :mod:`services.common.grpc_aio_server`
bind with :meth:`TransportSecurity.bind`, and the threaded one (every internal service) installs
:class:`TokenInterceptor`; every client opens its channel with :func:`open_channel` or
:func:`open_aio_channel`.
"""

from __future__ import annotations

import argparse
import hmac
import ssl
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from services.common.config import parse_bool, resolve
from services.common.errors import InvalidArgument

TOKEN_METADATA_KEY = "x-shardline-internal-token"
# Probes (docker-compose healthchecks, `shardline up` waiting for SERVING) carry no secret.
OPEN_METHOD_PREFIXES = ("/grpc.health.v1.Health/",)
# The services that demand the internal token; the router's public API checks the API key.
INTERNAL_SERVICES = ("worker", "planner", "loader", "telemetry")


def add_security_arguments(parser: argparse.ArgumentParser) -> None:
    """The transport-security flags, the same on every service and on ``shardline up``."""
    group = parser.add_argument_group("transport security")
    group.add_argument("--tls-cert", default=None,
                       help="PEM certificate: serve TLS with it, and present it to peers under --mtls "
                            "(env SHARDLINE_TLS_CERT)")
    group.add_argument("--tls-key", default=None, help="PEM private key of --tls-cert (env SHARDLINE_TLS_KEY)")
    group.add_argument("--tls-ca", default=None,
                       help="PEM CA bundle: connect to other services over TLS and verify them against it; "
                            "under --mtls, also verify clients (env SHARDLINE_TLS_CA)")
    group.add_argument("--mtls", action="store_const", const=True, default=None,
                       help="internal services require a client certificate signed by --tls-ca "
                            "(env SHARDLINE_MTLS)")
    group.add_argument("--internal-token", default=None,
                       help="shared secret that internal services require from their callers "
                            "(prefer env SHARDLINE_INTERNAL_TOKEN: a flag shows in ps)")


@dataclass(frozen=True)
class TransportSecurity:
    """One process's transport-security settings; the default is plaintext with no token."""

    cert_file: str | None = None
    key_file: str | None = None
    ca_file: str | None = None
    mtls: bool = False
    internal_token: str | None = None

    def __post_init__(self) -> None:
        if (self.cert_file is None) != (self.key_file is None):
            raise InvalidArgument("--tls-cert and --tls-key go together: give both or neither")
        if self.mtls and (self.ca_file is None or self.cert_file is None):
            raise InvalidArgument("--mtls needs --tls-ca (to verify peers) and --tls-cert/--tls-key (to be verified)")
        for flag, path in (("--tls-cert", self.cert_file), ("--tls-key", self.key_file), ("--tls-ca", self.ca_file)):
            if path is not None and not Path(path).is_file():
                raise InvalidArgument(f"{flag} {path}: no such file")
        if self.internal_token is not None and not self.internal_token.strip():
            raise InvalidArgument("--internal-token must not be empty")

    @classmethod
    def from_args(cls, args: argparse.Namespace | None = None, *,
                  environ: Mapping[str, str] | None = None) -> TransportSecurity:
        """From the flags of :func:`add_security_arguments` (absent ones count as not given),
        then the environment."""

        def flag(name: str) -> Any:
            return getattr(args, name, None) if args is not None else None

        return cls(
            cert_file=resolve("tls_cert", flag("tls_cert"), "", environ=environ) or None,
            key_file=resolve("tls_key", flag("tls_key"), "", environ=environ) or None,
            ca_file=resolve("tls_ca", flag("tls_ca"), "", environ=environ) or None,
            mtls=resolve("mtls", flag("mtls"), False, cast=parse_bool, environ=environ),
            internal_token=resolve("internal_token", flag("internal_token"), "", environ=environ) or None,
        )

    @property
    def serves_tls(self) -> bool:
        return self.cert_file is not None

    @property
    def dials_tls(self) -> bool:
        return self.ca_file is not None

    def environ(self) -> dict[str, str]:
        """These settings as the environment variables :meth:`from_args` reads: how ``shardline
        up`` hands them to the processes it starts without putting the token on a command line."""
        values = {"SHARDLINE_TLS_CERT": self.cert_file, "SHARDLINE_TLS_KEY": self.key_file,
                  "SHARDLINE_TLS_CA": self.ca_file, "SHARDLINE_MTLS": "1" if self.mtls else None,
                  "SHARDLINE_INTERNAL_TOKEN": self.internal_token}
        return {k: v for k, v in values.items() if v is not None}

    # -- the serving side --------------------------------------------------------------------
    def bind(self, server: Any, address: str, *, service: str) -> int:
        """Add ``address`` to a sync or aio ``server``: TLS when a certificate is set (client
        certificates required on an internal service under mTLS), plaintext otherwise."""
        if not self.serves_tls:
            return server.add_insecure_port(address)
        require_client = self.mtls and service in INTERNAL_SERVICES
        credentials = grpc.ssl_server_credentials(
            [(_read(self.key_file), _read(self.cert_file))],
            root_certificates=_read(self.ca_file) if require_client else None,
            require_client_auth=require_client)
        return server.add_secure_port(address, credentials)

    def required_token(self, service: str) -> str | None:
        """The token ``service`` demands of its callers, or None."""
        return self.internal_token if service in INTERNAL_SERVICES else None

    def server_ssl_context(self) -> ssl.SSLContext | None:
        """For an HTTP port (``/metrics``): TLS with the process's certificate, or None."""
        if not self.serves_tls:
            return None
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.load_cert_chain(self.cert_file, self.key_file)
        return context

    # -- the calling side --------------------------------------------------------------------
    def channel_credentials(self) -> grpc.ChannelCredentials | None:
        if not self.dials_tls:
            return None
        own = self.cert_file is not None
        return grpc.ssl_channel_credentials(
            root_certificates=_read(self.ca_file),
            private_key=_read(self.key_file) if own else None,
            certificate_chain=_read(self.cert_file) if own else None)

    def call_metadata(self) -> tuple[tuple[str, str], ...]:
        return ((TOKEN_METADATA_KEY, self.internal_token),) if self.internal_token else ()

    def client_ssl_context(self) -> ssl.SSLContext | None:
        """For fetching another service's HTTPS ``/metrics``: verify it against the CA."""
        if not self.dials_tls:
            return None
        context = ssl.create_default_context(cafile=self.ca_file)
        if self.cert_file is not None:
            context.load_cert_chain(self.cert_file, self.key_file)
        return context

    def http_headers(self) -> dict[str, str]:
        """What a scrape of an internal service's ``/metrics`` sends under ``--metrics-auth``."""
        return {"Authorization": f"Bearer {self.internal_token}"} if self.internal_token else {}


def _read(path: str | None) -> bytes | None:
    return None if path is None else Path(path).read_bytes()


def token_matches(presented: str | None, expected: str) -> bool:
    return presented is not None and hmac.compare_digest(presented.encode(), expected.encode())


def _token_of(metadata: Sequence[tuple[str, Any]] | None) -> str | None:
    for key, value in metadata or ():
        if key == TOKEN_METADATA_KEY:
            return value if isinstance(value, str) else value.decode(errors="replace")
    return None


def needs_token(method: str) -> bool:
    return not method.startswith(OPEN_METHOD_PREFIXES)


_REFUSAL = "this service requires the internal token (x-shardline-internal-token); see --internal-token"


def _refusing_handler(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """A handler of ``handler``'s kind that answers UNAUTHENTICATED without running it. A call
    that streams requests has its first one read before the answer, so the client is not still
    sending when the server closes (its status would then read INTERNAL, not UNAUTHENTICATED)."""

    def refuse(_request: Any, context: grpc.ServicerContext) -> Any:
        context.abort(grpc.StatusCode.UNAUTHENTICATED, _REFUSAL)

    def refuse_stream(requests: Any, context: grpc.ServicerContext) -> Any:
        next(iter(requests), None)
        context.abort(grpc.StatusCode.UNAUTHENTICATED, _REFUSAL)

    kwargs = {"request_deserializer": handler.request_deserializer,
              "response_serializer": handler.response_serializer}
    if handler.unary_unary is not None:
        return grpc.unary_unary_rpc_method_handler(refuse, **kwargs)
    if handler.unary_stream is not None:
        return grpc.unary_stream_rpc_method_handler(refuse, **kwargs)
    if handler.stream_unary is not None:
        return grpc.stream_unary_rpc_method_handler(refuse_stream, **kwargs)
    return grpc.stream_stream_rpc_method_handler(refuse_stream, **kwargs)


class TokenInterceptor(grpc.ServerInterceptor):
    """Every RPC but the open ones must carry the internal token. The internal services all run
    the threaded server; the router, the one asyncio server, checks the API key instead."""

    def __init__(self, token: str) -> None:
        self._token = token

    def intercept_service(self, continuation: Callable[[grpc.HandlerCallDetails], Any],
                          details: grpc.HandlerCallDetails) -> Any:
        handler = continuation(details)
        if handler is None or not needs_token(details.method) or \
                token_matches(_token_of(details.invocation_metadata), self._token):
            return handler
        return _refusing_handler(handler)


class _MetadataAdder(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
                     grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    """Adds fixed metadata (the internal token) to every call on a threaded channel."""

    def __init__(self, metadata: tuple[tuple[str, str], ...]) -> None:
        self._metadata = metadata

    def _details(self, details: grpc.ClientCallDetails) -> grpc.ClientCallDetails:
        return _CallDetails(details.method, details.timeout, (*(details.metadata or ()), *self._metadata),
                            details.credentials, getattr(details, "wait_for_ready", None),
                            getattr(details, "compression", None))

    def intercept_unary_unary(self, continuation, details, request):  # noqa: ANN001, ANN201
        return continuation(self._details(details), request)

    def intercept_unary_stream(self, continuation, details, request):  # noqa: ANN001, ANN201
        return continuation(self._details(details), request)

    def intercept_stream_unary(self, continuation, details, requests):  # noqa: ANN001, ANN201
        return continuation(self._details(details), requests)

    def intercept_stream_stream(self, continuation, details, requests):  # noqa: ANN001, ANN201
        return continuation(self._details(details), requests)


class _CallDetails(grpc.ClientCallDetails):
    def __init__(self, method, timeout, metadata, credentials, wait_for_ready, compression):  # noqa: ANN001
        self.method, self.timeout, self.metadata = method, timeout, metadata
        self.credentials, self.wait_for_ready, self.compression = credentials, wait_for_ready, compression


class _AioMetadata:
    """Adds fixed metadata (the internal token) to calls on an asyncio channel; grpc.aio files an
    interceptor under its first kind only, so :func:`_aio_metadata_adders` makes one per kind."""

    def __init__(self, metadata: tuple[tuple[str, str], ...]) -> None:
        self._metadata = metadata

    def _details(self, details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
        metadata = grpc.aio.Metadata(*(details.metadata or ()), *self._metadata)
        return grpc.aio.ClientCallDetails(details.method, details.timeout, metadata, details.credentials,
                                          details.wait_for_ready)


class _AioUnaryUnary(_AioMetadata, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation, details, request):  # noqa: ANN001, ANN201
        return await continuation(self._details(details), request)


class _AioUnaryStream(_AioMetadata, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation, details, request):  # noqa: ANN001, ANN201
        return await continuation(self._details(details), request)


class _AioStreamUnary(_AioMetadata, grpc.aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(self, continuation, details, requests):  # noqa: ANN001, ANN201
        return await continuation(self._details(details), requests)


class _AioStreamStream(_AioMetadata, grpc.aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(self, continuation, details, requests):  # noqa: ANN001, ANN201
        return await continuation(self._details(details), requests)


def _aio_metadata_adders(metadata: tuple[tuple[str, str], ...]) -> list[_AioMetadata]:
    return [kind(metadata) for kind in (_AioUnaryUnary, _AioUnaryStream, _AioStreamUnary, _AioStreamStream)]


def open_channel(address: str, security: TransportSecurity | None = None, *,
                 options: Sequence[tuple[str, Any]] = ()) -> grpc.Channel:
    """A threaded channel to ``address``: TLS when a CA is set, the token on every call when set.
    ``security`` None reads the settings from the environment."""
    security = TransportSecurity.from_args() if security is None else security
    credentials = security.channel_credentials()
    channel = grpc.secure_channel(address, credentials, options=list(options)) if credentials is not None \
        else grpc.insecure_channel(address, options=list(options))
    metadata = security.call_metadata()
    return grpc.intercept_channel(channel, _MetadataAdder(metadata)) if metadata else channel


def open_aio_channel(address: str, security: TransportSecurity | None = None, *,
                     options: Sequence[tuple[str, Any]] = ()) -> grpc.aio.Channel:
    """The asyncio twin of :func:`open_channel` (on the running event loop)."""
    security = TransportSecurity.from_args() if security is None else security
    credentials = security.channel_credentials()
    metadata = security.call_metadata()
    interceptors = _aio_metadata_adders(metadata) if metadata else None
    if credentials is not None:
        return grpc.aio.secure_channel(address, credentials, options=list(options), interceptors=interceptors)
    return grpc.aio.insecure_channel(address, options=list(options), interceptors=interceptors)
