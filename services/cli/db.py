"""``shardline db upgrade|current``: create or migrate the shard registry's schema."""

from __future__ import annotations

import argparse

from sqlalchemy.engine import make_url

from services.common.registry import migrate, registry_url


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("db", help="shard registry schema (Alembic migrations)")
    actions = parser.add_subparsers(dest="db_command", metavar="ACTION", required=True)
    for name, help_text, func in (
        ("upgrade", "create or migrate the registry schema to the latest revision", _upgrade),
        ("current", "print the registry's schema revision", _current),
    ):
        sub = actions.add_parser(name, help=help_text)
        sub.add_argument("--url", default=None,
                         help="registry URL (postgresql+psycopg://... or sqlite:///PATH); default "
                              "$SHARDLINE_REGISTRY_URL, else sqlite:///$SHARDLINE_STATE_DIR/registry.db")
        sub.set_defaults(func=func)


def _shown(url: str) -> str:
    return make_url(url).render_as_string(hide_password=True)


def _upgrade(args: argparse.Namespace) -> int:
    url = registry_url(args.url)
    migrate.upgrade(url)
    print(f"registry at {_shown(url)}: schema at revision {migrate.current_revision(url)} (head)")
    return 0


def _current(args: argparse.Namespace) -> int:
    url = registry_url(args.url)
    current = migrate.current_revision(url)
    head = migrate.head_revision()
    state = "up to date" if current == head else f"behind head {head}: run `shardline db upgrade`"
    print(f"registry at {_shown(url)}: revision {current or 'none'} ({state})")
    return 0 if current == head else 1
