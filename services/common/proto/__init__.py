"""Generated protobuf and gRPC code for ``protos/shardline/v1`` (the only tracked file here).

The modules are built by ``python -m services.common.protogen`` (``make proto``; ``make test``
and ``make run`` do it first) into ``services/common/proto/shardline/v1/``, which git ignores:
never edit them by hand. Import them from here::

    from services.common.proto import worker_pb2, worker_pb2_grpc

protoc writes imports between generated files as ``from shardline.v1 import common_pb2``, so
this package puts its own directory on ``sys.path`` to make ``shardline.v1`` importable. That
is also why the repository must never have a top-level package named ``shardline``: it would
shadow this one (checked below, with a clear error).

Only gRPC-facing code (``server.py`` files, clients, the CLI) imports this; domain modules
never do, so a wire-format change stays at the edges.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from types import ModuleType

_HERE = Path(__file__).resolve().parent
_GENERATED = _HERE / "shardline" / "v1"
PROTO_MODULES = ("common", "worker", "router", "planner", "loader", "telemetry")

if str(_HERE) not in sys.path:
    sys.path.insert(0, str(_HERE))


def _load(name: str) -> ModuleType:
    if not (_GENERATED / f"{name}.py").exists():
        raise ImportError(
            f"generated protobuf module {name} is missing from {_GENERATED}: "
            "run `python -m services.common.protogen` (or `make proto`)"
        )
    module = importlib.import_module(f"shardline.v1.{name}")
    origin = Path(module.__file__ or "").resolve()
    if _HERE not in origin.parents:
        raise ImportError(
            f"`shardline.v1.{name}` resolved to {origin}, not to the generated code under {_HERE}: "
            "a top-level `shardline` package on sys.path shadows it"
        )
    return module


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
