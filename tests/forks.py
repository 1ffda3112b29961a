"""The services the tests start, forked from one fork server per service in each test process.

The suite starts a worker, a router, a telemetry service or a fleet controller about a hundred
times; as fresh interpreters they spent much of their CPU importing (a worker 3 s, most of it
importing torch, on the 2-core AMD EPYC). Here each is forked from a server that imported that
service once (``services.common.fork_server``, which the fleet's local provisioner starts its
replica groups with): the same entry point, command line, own session and log file as
``python -m services.cli serve NAME``. A start with an environment of its own is a fresh
interpreter (the server's modules were imported under its environment), and so are the tests
that are about starting one: the five service shells, the netns groups, torchrun's nodes and
everything ``shardline up`` starts (it forks its services, routers and replica groups from a
fork server of its own).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from services.common.fork_server import ForkedProcess, ForkServer

REPO = Path(__file__).resolve().parents[1]
FORKED = ("worker", "router", "telemetry", "fleet")
_servers: dict[tuple[str, tuple[tuple[str, str], ...]], ForkServer] = {}


def start(argv: list[str], log: Path, env: dict[str, str], *, forked: bool = True,
          append: bool = False) -> subprocess.Popen | ForkedProcess:
    """``python -m services.cli *argv`` in the repository, in its own session, its output to
    ``log``; forked when ``forked`` and it is ``serve`` of a service in :data:`FORKED`. pytest's
    name of the running test is left out of its environment: it would make every test's a new one."""
    env = {k: v for k, v in env.items() if k != "PYTEST_CURRENT_TEST"}
    command = [sys.executable, "-m", "services.cli", *argv]
    if forked and len(argv) > 1 and argv[0] == "serve" and argv[1] in FORKED:
        key = (argv[1], tuple(sorted(env.items())))
        if key not in _servers:
            _servers[key] = ForkServer(["services.cli", "services.cli.serve", f"services.{argv[1]}.server"],
                                       environ=env)
        try:
            return _servers[key].spawn(command, env, log, append=append, cwd=REPO)
        except OSError as exc:
            print(f"{' '.join(argv[:2])}: {exc}; starting a fresh process", file=sys.stderr)
    with log.open("ab" if append else "wb") as out:
        return subprocess.Popen(command, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
