"""``shardline serve NAME [flags]``: run one of the five gRPC services in the foreground.

The service's module is imported only when that service is run: the worker pulls in torch,
and ``shardline model ...`` should not pay for it. So ``serve`` takes the service name and
hands the rest of the command line to the service's own parser (``shardline serve worker
--help`` shows the worker's flags). ``python -m services.<name>`` goes through the same
:func:`services.common.service_main.run_service`.
"""

from __future__ import annotations

import argparse
import importlib
from types import ModuleType

from services.common.config import DEFAULT_PORTS
from services.common.service_main import SERVICES, build_service_parser, run_service


def register(subparsers: argparse._SubParsersAction) -> None:
    services = ", ".join(f"{name} ({port})" for name, port in DEFAULT_PORTS.items())
    parser = subparsers.add_parser(
        "serve",
        help="run one gRPC service (router, worker, planner, loader, telemetry, fleet)",
        description=f"Run one shardline gRPC service until SIGTERM/SIGINT. Services and default "
                    f"ports: {services}. `shardline serve NAME --help` lists that service's flags.",
    )
    parser.add_argument("service", choices=SERVICES, help="which service to run")
    parser.add_argument("service_args", nargs=argparse.REMAINDER, metavar="...",
                        help="flags for the service: --host, --port, --log-level, and its own")
    parser.set_defaults(func=_run)


def service_module(name: str) -> ModuleType:
    if name not in SERVICES:
        raise ValueError(f"unknown service {name!r}; expected one of {', '.join(SERVICES)}")
    # deferred: by name, so that a run imports only the service it runs (the worker pulls in torch)
    return importlib.import_module(f"services.{name}.server")


def service_parser(name: str, *, prog: str) -> argparse.ArgumentParser:
    return build_service_parser(name, service_module(name), prog=prog)


def _run(args: argparse.Namespace) -> int:
    return run_service(args.service, service_module(args.service), args.service_args,
                       prog=f"shardline serve {args.service}")
