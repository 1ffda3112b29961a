"""``shardline serve NAME [flags]``: run one of the five gRPC services in the foreground.

Each service lives in ``services/<name>/server.py`` and exposes the same three things:

- ``add_arguments(parser)``: its own flags (worker ``--model --tp --pp``, router ``--http-port``…);
- ``serve(args) -> int``: build the servicer, serve until SIGTERM/SIGINT, return the exit code;
- the common flags (``--host --port --log-level --grace --max-workers``) come from
  :func:`services.common.config.add_server_arguments`, added here for every service.

The service's module is imported only when that service is run: the worker pulls in torch,
and ``shardline model ...`` should not pay for it. So ``serve`` takes the service name and
hands the rest of the command line to the service's own parser (``shardline serve worker
--help`` shows the worker's flags). ``python -m services.<name>`` goes through the same path.
"""

from __future__ import annotations

import argparse
import importlib
from types import ModuleType

from services.common.config import DEFAULT_PORTS, add_server_arguments

SERVICES: tuple[str, ...] = tuple(DEFAULT_PORTS)


def register(subparsers: argparse._SubParsersAction) -> None:
    services = ", ".join(f"{name} ({port})" for name, port in DEFAULT_PORTS.items())
    parser = subparsers.add_parser(
        "serve",
        help="run one gRPC service (router, worker, planner, loader, telemetry)",
        description=f"Run one shardline gRPC service until SIGTERM/SIGINT. Services and default "
                    f"ports: {services}. `shardline serve NAME --help` lists that service's flags.",
    )
    parser.add_argument("service", choices=SERVICES, help="which service to run")
    parser.add_argument("service_args", nargs=argparse.REMAINDER, metavar="...",
                        help="flags for the service: --host, --port, --log-level, and its own")
    parser.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    return run_service(args.service, args.service_args, prog=f"shardline serve {args.service}")


def service_module(name: str) -> ModuleType:
    if name not in SERVICES:
        raise ValueError(f"unknown service {name!r}; expected one of {', '.join(SERVICES)}")
    return importlib.import_module(f"services.{name}.server")


def build_service_parser(name: str, *, prog: str) -> argparse.ArgumentParser:
    """The full parser of one service: the common server flags plus the service's own."""
    module = service_module(name)
    summary = (module.__doc__ or "").strip().splitlines()
    parser = argparse.ArgumentParser(prog=prog, description=summary[0] if summary else None)
    add_server_arguments(parser, service=name)
    module.add_arguments(parser)
    return parser


def run_service(name: str, argv: list[str], *, prog: str) -> int:
    """Parse ``argv`` with the service's parser and serve; returns the exit code."""
    parser = build_service_parser(name, prog=prog)
    args = parser.parse_args(argv)
    return int(service_module(name).serve(args))
