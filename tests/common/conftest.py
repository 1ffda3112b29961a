"""The shard registry's databases: real PostgreSQL (psycopg 3) and a SQLite file."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.stack import fresh_database


@pytest.fixture(params=["postgresql", "sqlite"])
def db_url(request: pytest.FixtureRequest, tmp_path) -> Iterator[str]:
    """An empty database per test: a fresh PostgreSQL database, or a new SQLite file."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'registry.db'}"
        return
    with fresh_database(request.getfixturevalue("postgres_url"), "registry") as url:
        yield url
