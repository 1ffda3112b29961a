"""Generated protobuf and gRPC code for ``protos/shardline/v1`` (the only tracked file here).

The modules are built by ``python -m services.common.protogen`` (``make proto``; ``make test``
and ``make run`` do it first) into ``services/common/proto/shardline/v1/``, which git ignores:
never edit them by hand. Import them from here::

    from services.common.proto import worker_pb2, worker_pb2_grpc

The generated files import each other by this package's full name
(``services.common.proto.shardline.v1``: protogen rewrites protoc's ``from shardline.v1``), so
nothing here touches ``sys.path``.

Only gRPC-facing code (``server.py`` files, clients, the CLI) imports this; domain modules
never do, so a wire-format change stays at the edges.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from types import ModuleType

_HERE = Path(__file__).resolve().parent
_GENERATED = _HERE / "shardline" / "v1"
PROTO_MODULES = ("common", "worker", "router", "planner", "loader", "telemetry")


def _load(name: str) -> ModuleType:
    if not (_GENERATED / f"{name}.py").exists():
        raise ImportError(
            f"generated protobuf module {name} is missing from {_GENERATED}: "
            "run `python -m services.common.protogen` (or `make proto`)"
        )
    # deferred: by name, so that a missing module gets the message above, not a bare ImportError
    return importlib.import_module(f"{__name__}.shardline.v1.{name}")


common_pb2 = _load("common_pb2")
worker_pb2 = _load("worker_pb2")
worker_pb2_grpc = _load("worker_pb2_grpc")
router_pb2 = _load("router_pb2")
router_pb2_grpc = _load("router_pb2_grpc")
planner_pb2 = _load("planner_pb2")
planner_pb2_grpc = _load("planner_pb2_grpc")
loader_pb2 = _load("loader_pb2")
loader_pb2_grpc = _load("loader_pb2_grpc")
telemetry_pb2 = _load("telemetry_pb2")
telemetry_pb2_grpc = _load("telemetry_pb2_grpc")

__all__ = [
    "PROTO_MODULES",
    "common_pb2",
    "loader_pb2",
    "loader_pb2_grpc",
    "planner_pb2",
    "planner_pb2_grpc",
    "router_pb2",
    "router_pb2_grpc",
    "telemetry_pb2",
    "telemetry_pb2_grpc",
    "worker_pb2",
    "worker_pb2_grpc",
]
