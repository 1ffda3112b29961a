"""Alembic environment for the shard registry.

Run programmatically (``services.common.registry.migrate.upgrade(url)``): the caller puts an
open connection in ``config.attributes["connection"]`` or a URL in ``config.attributes["url"]``;
there is no alembic.ini. Offline (``--sql``) mode is not supported.
"""

from __future__ import annotations

from alembic import context

from services.common.registry.engine import make_engine
from services.common.registry.models import Base

config = context.config
target_metadata = Base.metadata


def run_migrations_online() -> None:
    connection = config.attributes.get("connection")
    if connection is not None:
        context.configure(connection=connection, target_metadata=target_metadata,
                          render_as_batch=connection.dialect.name == "sqlite")
        with context.begin_transaction():
            context.run_migrations()
        return
    url = config.attributes.get("url")
    if not url:
        raise RuntimeError("registry migration needs config.attributes['url'] or ['connection']")
    engine = make_engine(url)
    try:
        with engine.connect() as conn:
            context.configure(connection=conn, target_metadata=target_metadata,
                              render_as_batch=conn.dialect.name == "sqlite")
            with context.begin_transaction():
                context.run_migrations()
    finally:
        engine.dispose()


if context.is_offline_mode():
    raise RuntimeError("the shard registry migrations run online only (pass a URL or connection)")
run_migrations_online()
