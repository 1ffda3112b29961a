"""Run the registry's Alembic migrations programmatically (no alembic.ini needed).

Alembic is imported by the functions that use it: every worker, router and controller process
imports the registry, and only ``shardline db`` and a registry opened with ``migrate_schema``
migrate (alembic's import is ~0.3 s of CPU, a process start's tenth).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from sqlalchemy import Engine

from .engine import make_engine

if TYPE_CHECKING:
    from alembic.config import Config

MIGRATIONS_DIR = Path(__file__).with_name("migrations")


def alembic_config() -> Config:
    # deferred: alembic only where a migration runs (see the module docstring)
    from alembic.config import Config

    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS_DIR))
    return config


def _run(target: str | Engine, action: str, revision: str) -> None:
    # deferred: as in alembic_config
    from alembic import command

    engine = make_engine(target) if isinstance(target, str) else target
    try:
        with engine.connect() as connection:
            sqlite = connection.dialect.name == "sqlite"
            if sqlite:
                # SQLite changes a table's checks or columns by rebuilding it (copy, drop, rename:
                # Alembic's batch mode), and with foreign keys on, dropping a table other rows refer
                # to fails (replica groups with shards). Its own procedure: foreign keys off outside
                # the transaction, every reference checked before the commit, then on again.
                connection.exec_driver_sql("PRAGMA foreign_keys=OFF")
                connection.commit()
            try:
                with connection.begin():
                    config = alembic_config()
                    config.attributes["connection"] = connection
                    getattr(command, action)(config, revision)
                    if sqlite and (broken := connection.exec_driver_sql("PRAGMA foreign_key_check").fetchall()):
                        raise RuntimeError(f"registry {action} to {revision} would break references: {broken}")
            finally:
                if sqlite:
                    connection.exec_driver_sql("PRAGMA foreign_keys=ON")
                    connection.commit()
    finally:
        if isinstance(target, str):
            engine.dispose()


def upgrade(target: str | Engine, revision: str = "head") -> None:
    """``alembic upgrade head`` against a URL (the SQLite file's directory is created) or an
    existing engine (needed for ``sqlite:///:memory:``, which lives in one engine's pool)."""
    _run(target, "upgrade", revision)


def downgrade(target: str | Engine, revision: str = "base") -> None:
    """``alembic downgrade base``: drops the registry tables."""
    _run(target, "downgrade", revision)


def head_revision() -> str:
    # deferred: as in alembic_config
    from alembic.script import ScriptDirectory

    head = ScriptDirectory.from_config(alembic_config()).get_current_head()
    if head is None:
        raise RuntimeError(f"no Alembic revisions found in {MIGRATIONS_DIR}")
    return head


def current_revision(url: str) -> str | None:
    """The revision the database at ``url`` is at (None before the first upgrade)."""
    # deferred: as in alembic_config
    from alembic.runtime.migration import MigrationContext

    engine = make_engine(url)
    try:
        with engine.connect() as connection:
            return MigrationContext.configure(connection).get_current_revision()
    finally:
        engine.dispose()
