"""The `shardline` command: one entry point, one module per subcommand.

Each module in this package that defines ``register(subparsers)`` adds its subcommand; the
parsed namespace carries ``func`` (called with the namespace, returns an exit code).
Modules are discovered, so adding a subcommand never edits this file.
"""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="shardline",
        description="Plan, shard, run, route and watch a Llama-family model split across ranks.",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        if info.name.startswith("_"):
            continue
        module = importlib.import_module(f"{__name__}.{info.name}")
        register = getattr(module, "register", None)
        if register is not None:
            register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "func", None) is None:
        parser.print_help()
        return 2
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
