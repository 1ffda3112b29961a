"""``shardline bench NAME [args...]``: run the benchmark module ``bench/NAME.py`` (its ``main(argv)``).

Benchmarks live in the repository's ``bench/`` folder (not in the installed package), one module
per target, each writing ``bench/results/NAME.json`` and ``.md``; this command only dispatches,
so adding ``bench/foo.py`` with a ``main(argv)`` makes ``shardline bench foo`` work.
"""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys
from pathlib import Path


def _bench_package():
    try:
        return importlib.import_module("bench")
    except ImportError:
        # the console script does not put the working directory on sys.path
        sys.path.insert(0, str(Path.cwd()))
        return importlib.import_module("bench")


def targets() -> list[str]:
    try:
        package = _bench_package()
    except ImportError:
        return []
    return sorted(m.name for m in pkgutil.iter_modules(package.__path__) if not m.name.startswith("_"))


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("bench", help="run a benchmark from bench/ (writes bench/results/NAME.*)",
                                   description="Run bench/NAME.py; `shardline bench NAME --help` lists its flags.")
    parser.add_argument("target", metavar="NAME", help=f"benchmark: {', '.join(targets()) or 'none found'}")
    parser.add_argument("bench_args", nargs=argparse.REMAINDER, metavar="...", help="the benchmark's own flags")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    available = targets()
    if args.target not in available:
        print(f"shardline bench: unknown benchmark {args.target!r}; expected one of {', '.join(available)} "
              f"(run from the repository root)", file=sys.stderr)
        return 2
    module = importlib.import_module(f"bench.{args.target}")
    main = getattr(module, "main", None)
    if main is None:
        print(f"shardline bench: bench/{args.target}.py has no main(argv)", file=sys.stderr)
        return 2
    return int(main(args.bench_args) or 0)
