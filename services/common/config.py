"""Settings: a command-line flag wins over a ``SHARDLINE_<NAME>`` environment variable, which
wins over the built-in default.

Flags are declared with ``default=None`` so that "not given" can be told apart from "given the
default value"; :func:`resolve` then applies the precedence. One place does this so every
service (and ``docker-compose.yml``, which configures through the environment) agrees.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar

from services.common.errors import InvalidArgument

ENV_PREFIX = "SHARDLINE_"

T = TypeVar("T")

# The five services and their default gRPC ports. `shardline up`, docker-compose.yml and the
# README use the same numbers.
DEFAULT_PORTS: dict[str, int] = {
    "router": 50051,
    "worker": 50052,
    "planner": 50053,
    "loader": 50054,
    "telemetry": 50055,
    "fleet": 50056,
}

# Internal services bind loopback unless told otherwise: nothing is exposed by accident.
DEFAULT_HOST = "127.0.0.1"
DEFAULT_GRACE_S = 5.0
# Each in-flight RPC (a token stream included) holds one thread for its whole life.
DEFAULT_MAX_WORKERS = 64
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")


# The one setting a child process keeps from its parent's environment: the CPU kernels' build
# target. A child built for another -march would compile the kernels anew (tens of seconds, while
# a test or a benchmark waits on it) and run other code than its parent.
INHERITED_SETTINGS = ("SHARDLINE_CPU_ARCH",)


def child_environ(**extra: str) -> dict[str, str]:
    """This process's environment without its ``SHARDLINE_*`` settings (a child takes its settings
    from its own flags and ``extra``), but for :data:`INHERITED_SETTINGS`, plus ``extra``."""
    return {**{k: v for k, v in os.environ.items() if not k.startswith(ENV_PREFIX) or k in INHERITED_SETTINGS},
            **extra}


def env_name(name: str) -> str:
    """``"redis_url"`` -> ``"SHARDLINE_REDIS_URL"``."""
    return ENV_PREFIX + name.upper().replace("-", "_")


def resolve(
    names: str | Sequence[str],
    flag_value: T | None,
    default: T,
    *,
    cast: Callable[[str], T] | None = None,
    environ: Mapping[str, str] | None = None,
) -> T:
    """The value of a setting: ``flag_value`` if given, else the first ``SHARDLINE_<NAME>``
    variable set (``names`` in order, most specific first), else ``default``.

    Environment values are strings; ``cast`` (default: the type of ``default``) converts them,
    and a value that does not convert raises :class:`InvalidArgument` naming the variable.
    """
    if flag_value is not None:
        return flag_value
    env = os.environ if environ is None else environ
    for name in [names] if isinstance(names, str) else names:
        var = env_name(name)
        raw = env.get(var)
        if raw is None or raw == "":
            continue
        convert = cast if cast is not None else _caster_for(default)
        try:
            return convert(raw)
        except ValueError as exc:
            raise InvalidArgument(f"{var}={raw!r} is not a valid {_type_name(default)}: {exc}") from exc
    return default


def _caster_for(default: object) -> Callable[[str], object]:
    if isinstance(default, bool):
        return parse_bool
    if isinstance(default, (int, float)):
        return type(default)
    return str


def _type_name(default: object) -> str:
    return type(default).__name__ if default is not None else "value"


def parse_bool(raw: str) -> bool:
    """Accept the usual spellings of a boolean environment variable."""
    lowered = raw.strip().lower()
    if lowered in {"1", "true", "yes", "on"}:
        return True
    if lowered in {"0", "false", "no", "off"}:
        return False
    raise ValueError(f"expected one of 1/0, true/false, yes/no, on/off, got {raw!r}")


def add_server_arguments(parser: argparse.ArgumentParser, *, service: str) -> None:
    """Flags every gRPC service takes. Defaults are None: :meth:`ServerConfig.from_args` applies
    the env-var and built-in defaults, which the help text states."""
    port = DEFAULT_PORTS[service]
    group = parser.add_argument_group("server")
    group.add_argument("--host", default=None,
                       help=f"address to bind (env SHARDLINE_HOST; default {DEFAULT_HOST})")
    group.add_argument("--port", type=int, default=None,
                       help=f"gRPC port, 0 for any free port (env SHARDLINE_{service.upper()}_PORT "
                            f"or SHARDLINE_PORT; default {port})")
    group.add_argument("--log-level", default=None, type=str.upper, choices=LOG_LEVELS,
                       help="log level (env SHARDLINE_LOG_LEVEL; default INFO)")
    group.add_argument("--grace", type=float, default=None, dest="grace_s",
                       help=f"seconds in-flight RPCs get to finish on SIGTERM/SIGINT "
                            f"(env SHARDLINE_GRACE_S; default {DEFAULT_GRACE_S:g})")
    group.add_argument("--max-workers", type=int, default=None,
                       help=f"threads serving RPCs (a threaded server's open stream holds one; the "
                            f"router's asyncio server uses them only for blocking calls) "
                            f"(env SHARDLINE_MAX_WORKERS; default {DEFAULT_MAX_WORKERS})")
    group.add_argument("--dev", action="store_const", const=True, default=None,
                       help="development mode: serve gRPC reflection, so grpcurl can list and call the "
                            "services without their protos (env SHARDLINE_DEV; default off)")


@dataclass(frozen=True)
class ServerConfig:
    """Where and how one gRPC service listens."""

    service: str
    host: str = DEFAULT_HOST
    port: int = 0
    log_level: str = "INFO"
    grace_s: float = DEFAULT_GRACE_S
    max_workers: int = DEFAULT_MAX_WORKERS
    reflection: bool = False  # --dev: reflection lists and describes the services to anyone

    def __post_init__(self) -> None:
        if self.service not in DEFAULT_PORTS:
            raise InvalidArgument(f"unknown service {self.service!r}; expected one of {sorted(DEFAULT_PORTS)}")
        if not 0 <= self.port <= 65535:
            raise InvalidArgument(f"port must be in [0, 65535], got {self.port}")
        if self.grace_s < 0:
            raise InvalidArgument(f"grace must be >= 0 seconds, got {self.grace_s}")
        if self.log_level not in LOG_LEVELS:
            raise InvalidArgument(f"log level must be one of {', '.join(LOG_LEVELS)}, got {self.log_level!r}")
        if self.max_workers < 1:
            raise InvalidArgument(f"max_workers must be >= 1, got {self.max_workers}")

    @property
    def address(self) -> str:
        """``host:port`` as grpc expects it (IPv6 hosts in brackets)."""
        host = f"[{self.host}]" if ":" in self.host and not self.host.startswith("[") else self.host
        return f"{host}:{self.port}"

    @classmethod
    def from_args(
        cls, args: argparse.Namespace, *, service: str, environ: Mapping[str, str] | None = None
    ) -> ServerConfig:
        """Build from flags added by :func:`add_server_arguments`, then env, then defaults."""
        return cls(
            service=service,
            host=resolve("host", args.host, DEFAULT_HOST, environ=environ),
            port=resolve((f"{service}_port", "port"), args.port, DEFAULT_PORTS[service], environ=environ),
            log_level=resolve("log_level", args.log_level, "INFO", environ=environ).upper(),
            grace_s=resolve("grace_s", args.grace_s, DEFAULT_GRACE_S, environ=environ),
            max_workers=resolve("max_workers", args.max_workers, DEFAULT_MAX_WORKERS, environ=environ),
            reflection=resolve("dev", getattr(args, "dev", None), False, environ=environ),
        )
