"""Registry URLs and engines: PostgreSQL (psycopg 3) in production, a SQLite file embedded."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from sqlalchemy import Engine, create_engine, event
from sqlalchemy.engine import make_url

from .errors import InvalidValue

SUPPORTED_DRIVERS = ("postgresql+psycopg", "sqlite")


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
    kwargs.setdefault("pool_pre_ping", True)
    return create_engine(parsed, **kwargs)


def _sqlite_pragmas(dbapi_connection: Any, _record: Any) -> None:
    cursor = dbapi_connection.cursor()
    try:
        cursor.execute("PRAGMA foreign_keys=ON")
        cursor.execute("PRAGMA busy_timeout=5000")
        cursor.execute("PRAGMA journal_mode=WAL")
    finally:
        cursor.close()
