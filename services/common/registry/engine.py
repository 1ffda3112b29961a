"""Registry URLs and engines: PostgreSQL (psycopg 3) in production, a SQLite file embedded."""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, ParamSpec, TypeVar

from sqlalchemy import Engine, create_engine, event
from sqlalchemy.engine import make_url
from sqlalchemy.exc import DBAPIError

from .errors import InvalidValue

SUPPORTED_DRIVERS = ("postgresql+psycopg", "sqlite")
# seconds a connection attempt to a PostgreSQL that is down or unreachable may take: a caller's
# loop (a worker's heartbeat, the router's discovery) fails fast and tries again next round
CONNECT_TIMEOUT_S = 3

log = logging.getLogger(__name__)
P = ParamSpec("P")
R = TypeVar("R")


def state_dir() -> Path:
    """SHARDLINE_STATE_DIR, else ~/.local/state/shardline."""
    configured = os.environ.get("SHARDLINE_STATE_DIR")
    return Path(configured).expanduser() if configured else Path.home() / ".local/state/shardline"


def default_registry_url() -> str:
    """The embedded default: a SQLite file in the state directory."""
    return f"sqlite:///{state_dir() / 'registry.db'}"


def registry_url(url: str | None = None) -> str:
    """The URL given, else SHARDLINE_REGISTRY_URL, else the embedded SQLite default."""
    return url or os.environ.get("SHARDLINE_REGISTRY_URL") or default_registry_url()


def make_engine(url: str, **kwargs: Any) -> Engine:
    """An engine for ``postgresql+psycopg://...`` or ``sqlite:///PATH`` (parent dirs created).

    SQLite gets foreign keys on, WAL and a busy timeout, since several local processes share
    the embedded registry file.
    """
    parsed = make_url(url)
    driver = parsed.drivername
    if driver == "postgresql":  # plain postgresql:// means psycopg 3 here, not psycopg2
        parsed = parsed.set(drivername="postgresql+psycopg")
    elif driver not in SUPPORTED_DRIVERS:
        raise InvalidValue(
            f"unsupported registry URL scheme {driver!r}: expected one of "
            f"{', '.join(d + '://' for d in SUPPORTED_DRIVERS)}"
        )
    if parsed.drivername == "sqlite":
        database = parsed.database
        if database and database != ":memory:" and not database.startswith("file:"):
            Path(database).expanduser().parent.mkdir(parents=True, exist_ok=True)
        kwargs.setdefault("connect_args", {}).setdefault("check_same_thread", False)
        engine = create_engine(parsed, **kwargs)
        event.listen(engine, "connect", _sqlite_pragmas)
        return engine
    # a pooled connection is pinged at checkout, so one the server closed (it restarted) is
    # replaced before use rather than failing the caller
    kwargs.setdefault("pool_pre_ping", True)
    kwargs.setdefault("connect_args", {}).setdefault("connect_timeout", CONNECT_TIMEOUT_S)
    return create_engine(parsed, **kwargs)


def retry_on_disconnect(method: Callable[P, R]) -> Callable[P, R]:
    """Run ``method`` once more when a statement of its transaction failed because the
    connection was gone (the server restarted after the checkout ping, or with the ping off).

    Only a failed *statement* is retried: its transaction never reached COMMIT, so nothing of it
    was written and running it again is safe. A failed COMMIT (the write may have landed) and a
    refused connection (the server is down: a retry would fail the same way) are raised as they
    are. SQLAlchemy has already invalidated the dead connection and the pool's older ones.
    """

    @functools.wraps(method)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return method(*args, **kwargs)
        except DBAPIError as exc:
            if not exc.connection_invalidated or exc.statement is None or getattr(exc, "_retried", False):
                raise
            log.info("registry connection lost during %s (%s); retrying once", method.__name__, exc.orig)
        try:
            return method(*args, **kwargs)
        except DBAPIError as exc:
            exc._retried = True  # type: ignore[attr-defined]  # an enclosing retrying call must not repeat it
            raise
    return wrapper


def _sqlite_pragmas(dbapi_connection: Any, _record: Any) -> None:
    cursor = dbapi_connection.cursor()
    try:
        cursor.execute("PRAGMA foreign_keys=ON")
        cursor.execute("PRAGMA busy_timeout=5000")
        cursor.execute("PRAGMA journal_mode=WAL")
    finally:
        cursor.close()
