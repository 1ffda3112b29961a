"""``python -m services.common.healthcheck --port P``: exit 0 iff the gRPC health check says SERVING.

Used as the docker-compose healthcheck of every shardline service (the images have no
grpc_health_probe binary) and handy by hand. Exit codes: 0 SERVING, 1 anything else (NOT_SERVING,
unknown service, unreachable, timeout), with the reason on stderr.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.transport_security import TransportSecurity, open_channel


def check(address: str, *, service: str = "", timeout_s: float = 2.0,
          security: TransportSecurity | None = None) -> str:
    """The status name (``SERVING``, ``NOT_SERVING``, …) reported for ``service`` at ``address``
    ("" = the server as a whole). Raises grpc.RpcError when the server does not answer. TLS as
    ``security`` says (None: the ``SHARDLINE_TLS_*`` environment)."""
    with open_channel(address, security) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        response = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout_s)
    return health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)


def wait_serving(proc: subprocess.Popen, address: str, *, timeout_s: float, poll_s: float = 0.2) -> str | None:
    """Poll ``address`` until it says SERVING: None then, else why not (the process exited, or
    the deadline passed). For code that started a service as a subprocess and waits for it."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return f"{address} exited with {proc.returncode}"
        try:
            if check(address, timeout_s=1) == "SERVING":
                return None
        except grpc.RpcError:
            pass
        time.sleep(poll_s)
    return f"{address} not SERVING within {timeout_s:g} s"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m services.common.healthcheck", description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1", help="server address (default 127.0.0.1)")
    parser.add_argument("--port", type=int, required=True, help="gRPC port")
    parser.add_argument("--service", default="",
                        help="full service name, e.g. shardline.v1.RouterService (default: the whole server)")
    parser.add_argument("--timeout", type=float, default=2.0, help="seconds to wait for the answer (default 2)")
    args = parser.parse_args(argv)
    address = f"{args.host}:{args.port}"
    try:
        status = check(address, service=args.service, timeout_s=args.timeout)
    except grpc.RpcError as exc:
        print(f"{address}: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return 1
    what = args.service or "server"
    if status != "SERVING":
        print(f"{address} {what}: {status}", file=sys.stderr)
        return 1
    print(f"{address} {what}: SERVING")
    return 0


if __name__ == "__main__":
    sys.exit(main())
