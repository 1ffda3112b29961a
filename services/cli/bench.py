"""``shardline bench NAME [args...]``: run the benchmark ``bench/NAME.py`` as ``python -m bench.NAME``.

Benchmarks live in the repository's ``bench/`` folder (not in the installed package), one module
per target, each writing ``bench/results/NAME.json`` and ``.md``; this command finds them in the
working directory and runs the chosen one as a process of its own, so the CLI never imports the
layer above it. A module with a ``__main__`` block (or a package with ``__main__.py``) is a
target: adding ``bench/foo.py`` with one makes ``shardline bench foo`` work.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

MAIN_BLOCK = 'if __name__ == "__main__":'


def bench_dir() -> Path:
    return Path.cwd() / "bench"


def targets() -> list[str]:
    """The runnable benchmarks of the working directory's ``bench/`` (helpers start with ``_``)."""
    found = []
    for path in sorted(bench_dir().glob("*")):
        if path.name.startswith(("_", ".")):
            continue
        if path.suffix == ".py" and MAIN_BLOCK in path.read_text(errors="replace"):
            found.append(path.stem)
        elif path.is_dir() and (path / "__main__.py").is_file():
            found.append(path.name)
    return found


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
    return subprocess.run([sys.executable, "-m", f"bench.{args.target}", *args.bench_args],
                          cwd=bench_dir().parent).returncode
