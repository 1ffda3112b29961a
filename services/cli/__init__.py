"""The `shardline` command: one entry point, one module per subcommand.

Each module in this package that defines ``register(subparsers)`` adds its subcommand; the
parsed namespace carries ``func`` (called with the namespace, returns an exit code).
Modules are discovered, so adding a subcommand never edits this file. A module is named after
its subcommand (``shardline serve`` lives in ``serve.py``), so a run imports only the module of the
command it runs: ``shardline serve router`` never pays for importing torch.
"""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys

from services.common import heap


def command_modules() -> list[str]:
    return sorted(m.name for m in pkgutil.iter_modules(__path__) if not m.name.startswith("_"))


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="shardline",
        description="Plan, shard, run, route and watch a Llama-family model split across ranks.",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in [only] if only is not None else command_modules():
        # deferred: by name, so that `shardline X` imports only the command it runs
        module = importlib.import_module(f"{__name__}.{name}")
        register = getattr(module, "register", None)
        if register is not None:
            register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    heap.starting()  # a server calls heap.started() once it serves
    argv = sys.argv[1:] if argv is None else argv
    first = argv[0].replace("-", "_") if argv else None
    parser = build_parser(first if first in command_modules() else None)
    args = parser.parse_args(argv)
    if getattr(args, "func", None) is None:
        parser.print_help()
        return 2
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
