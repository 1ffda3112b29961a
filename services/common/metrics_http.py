"""A Prometheus ``/metrics`` endpoint on its own port, with TLS and a bearer check when asked.

prometheus_client's own ``start_http_server`` has TLS but no credential; this one serves the
same exposition (the process's default registry) from a daemon thread, behind
:class:`~services.common.bearer_auth.BearerCheck` (401 without the secret) and over TLS when an
SSL context is given.
"""

from __future__ import annotations

import logging
import ssl
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, CollectorRegistry, generate_latest

from services.common.bearer_auth import BearerCheck
from services.common.errors import Unauthenticated

log = logging.getLogger(__name__)


class MetricsHttpServer:
    """``GET /metrics`` (and ``/``) on ``host:port``; ``port`` 0 picks a free one."""

    def __init__(self, port: int, host: str = "127.0.0.1", *, registry: CollectorRegistry = REGISTRY,
                 auth: BearerCheck | None = None, ssl_context: ssl.SSLContext | None = None) -> None:
        check = auth or BearerCheck(None)

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                if self.path.split("?", 1)[0] not in ("/metrics", "/"):
                    self._reply(404, b"not found\n", "text/plain")
                    return
                try:
                    check.check(self.headers.get("authorization"))
                except Unauthenticated as exc:
                    self._reply(401, f"{exc}\n".encode(), "text/plain", {"WWW-Authenticate": "Bearer"})
                    return
                self._reply(200, generate_latest(registry), CONTENT_TYPE_LATEST)

            def _reply(self, status: int, body: bytes, content_type: str,
                       headers: dict[str, str] | None = None) -> None:
                self.send_response(status)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(body)))
                for key, value in (headers or {}).items():
                    self.send_header(key, value)
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - http.server's name
                log.debug("metrics %s: " + format, self.address_string(), *args)

        self._server = ThreadingHTTPServer((host, port), Handler)
        self._server.daemon_threads = True
        if ssl_context is not None:
            self._server.socket = ssl_context.wrap_socket(self._server.socket, server_side=True)
        self.scheme = "https" if ssl_context is not None else "http"
        self.server_port: int = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, name="metrics-http", daemon=True)
        self._thread.start()

    def shutdown(self) -> None:
        self._server.shutdown()
        self._server.server_close()
