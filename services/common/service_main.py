"""The entry point every service shares: ``python -m services.<name>`` and ``shardline serve NAME``.

Each service lives in ``services/<name>/server.py`` and exposes the same three things:

- ``add_arguments(parser)``: its own flags (worker ``--model --tp --pp``, router ``--http-port``…);
- ``serve(args) -> int``: build the servicer, serve until SIGTERM/SIGINT, return the exit code;
- the common flags (``--host --port --log-level --grace --max-workers``) come from
  :func:`services.common.config.add_server_arguments`, added here for every service.

The caller hands over the service's module, so this module never imports a service: the
``__main__`` of each service passes its own ``server`` module, and ``shardline serve`` looks the
module up by name.
"""

from __future__ import annotations

import argparse
from types import ModuleType

from services.common.config import DEFAULT_PORTS, add_server_arguments
from services.common.transport_security import add_security_arguments

SERVICES: tuple[str, ...] = tuple(DEFAULT_PORTS)


def build_service_parser(name: str, module: ModuleType, *, prog: str) -> argparse.ArgumentParser:
    """The full parser of one service: the common server flags plus the service's own."""
    if name not in SERVICES:
        raise ValueError(f"unknown service {name!r}; expected one of {', '.join(SERVICES)}")
    summary = (module.__doc__ or "").strip().splitlines()
    parser = argparse.ArgumentParser(prog=prog, description=summary[0] if summary else None)
    add_server_arguments(parser, service=name)
    add_security_arguments(parser)
    module.add_arguments(parser)
    return parser


def run_service(name: str, module: ModuleType, argv: list[str], *, prog: str) -> int:
    """Parse ``argv`` with the service's parser and serve; returns the exit code."""
    args = build_service_parser(name, module, prog=prog).parse_args(argv)
    return int(module.serve(args))
