"""Throw-away PostgreSQL and Redis on loopback for the test suite.

``python -m tests.stack -- CMD ...`` starts both on free ports, exports
``SHARDLINE_TEST_POSTGRES_URL`` and ``SHARDLINE_TEST_REDIS_URL`` to CMD, and stops them
whatever CMD does. ``tests/conftest.py`` uses the same context manager when the suite runs
without the wrapper, so plain ``pytest`` works too.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from services.common.ports import bindable
from services.common.ports import free_port as any_free_port

POSTGRES_BIN_DIRS = ("/usr/local/bin", "/usr/lib/postgresql/15/bin", "/usr/lib/postgresql/16/bin")
# one Redis database per pytest-xdist worker (tests/conftest.py), and 0 outside xdist
REDIS_DATABASES = 64


# Ports the tests choose come from a block of their own below the kernel's ephemeral range: a port
# picked, closed and bound later by a service cannot be handed out meanwhile by bind(0) elsewhere
# (the services' own rank ports, outgoing connections) nor to another pytest-xdist worker, which
# has another block. Block 0 is a process outside xdist (a one-process run, tests.stack itself).
PORT_BLOCKS_START = 10_000
PORT_BLOCK_SIZE = 2_000
# each pick skips the next few ports too: `shardline up --port-base B` takes B .. B+3
PORT_STRIDE = 4
_port_cursor: int | None = None


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _port_block() -> range | None:
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")  # "gw0", "gw1", ... under xdist
    slot = int(worker[2:]) + 1 if worker.startswith("gw") and worker[2:].isdigit() else 0
    start = PORT_BLOCKS_START + slot * PORT_BLOCK_SIZE
    if start + PORT_BLOCK_SIZE > _ephemeral_low():
        return None  # more workers than blocks: fall back to the kernel's choice
    return range(start, start + PORT_BLOCK_SIZE)


def free_port() -> int:
    """A loopback TCP port free now, never the same twice in a row from one process."""
    global _port_cursor
    block = _port_block()
    if block is not None:
        slots = len(block) // PORT_STRIDE
        if _port_cursor is None:  # a random start: two runs side by side rarely meet
            _port_cursor = random.randrange(slots)
        for _ in range(slots):
            port = block.start + (_port_cursor % slots) * PORT_STRIDE
            _port_cursor += 1
            if bindable(port):
                return port
    return any_free_port()


def _find_postgres_bin(name: str) -> str:
    for directory in POSTGRES_BIN_DIRS:
        candidate = Path(directory) / name
        if candidate.exists():
            return str(candidate)
    found = shutil.which(name)
    if found is None:
        raise RuntimeError(f"PostgreSQL binary {name!r} not found in {POSTGRES_BIN_DIRS} or PATH")
    return found


def _as_user_prefix() -> tuple[list[str], str | None]:
    """initdb and postgres refuse to run as root: run them as the `postgres` (or `nobody`) user."""
    if os.geteuid() != 0:
        return [], None
    for user in ("postgres", "nobody"):
        try:
            pwd.getpwnam(user)
        except KeyError:
            continue
        return ["runuser", "-u", user, "--"], user
    raise RuntimeError("running as root and neither a 'postgres' nor a 'nobody' user exists")


def _wait_for_port(port: int, timeout_s: float, what: str, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{what} exited with code {proc.returncode} before listening")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return
        time.sleep(0.1)
    raise RuntimeError(f"{what} did not listen on 127.0.0.1:{port} within {timeout_s} s")


@contextlib.contextmanager
def postgres() -> Iterator[str]:
    """A fresh PostgreSQL cluster in a temp dir; yields a SQLAlchemy URL (psycopg 3)."""
    prefix, user = _as_user_prefix()
    root = Path(tempfile.mkdtemp(prefix="shardline-pg-"))
    data = root / "data"
    data.mkdir()
    if user is not None:
        uid = pwd.getpwnam(user).pw_uid
        gid = pwd.getpwnam(user).pw_gid
        os.chown(root, uid, gid)
        os.chown(data, uid, gid)
    port = free_port()
    subprocess.run(
        [*prefix, _find_postgres_bin("initdb"), "-D", str(data), "-U", "shardline", "--auth=trust",
         "--no-sync", "-E", "UTF8"],
        check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, cwd=root,
    )
    proc = subprocess.Popen(
        [*prefix, _find_postgres_bin("postgres"), "-D", str(data), "-p", str(port), "-h", "127.0.0.1",
         "-k", str(root), "-c", "fsync=off", "-c", "synchronous_commit=off", "-c", "full_page_writes=off"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=root,
    )
    try:
        _wait_for_port(port, 30, "postgres", proc)
        # the default database "postgres" exists; create ours
        url_admin = f"postgresql+psycopg://shardline@127.0.0.1:{port}/postgres"
        import psycopg

        for _ in range(50):
            try:
                with psycopg.connect(url_admin.replace("+psycopg", ""), autocommit=True) as conn:
                    conn.execute("CREATE DATABASE shardline_test")
                break
            except psycopg.OperationalError:
                time.sleep(0.2)
        yield f"postgresql+psycopg://shardline@127.0.0.1:{port}/shardline_test"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        shutil.rmtree(root, ignore_errors=True)


@contextlib.contextmanager
def redis() -> Iterator[str]:
    """A fresh redis-server with no persistence on a free loopback port; yields redis://..."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise RuntimeError("redis-server not found: `make test` installs it (apt-get install redis-server)")
    port = free_port()
    root = Path(tempfile.mkdtemp(prefix="shardline-redis-"))
    proc = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
         "--dir", str(root), "--databases", str(REDIS_DATABASES)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    try:
        _wait_for_port(port, 15, "redis-server", proc)
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        shutil.rmtree(root, ignore_errors=True)


def main(argv: list[str]) -> int:
    if argv and argv[0] == "--":
        argv = argv[1:]
    if not argv:
        print("usage: python -m tests.stack -- CMD [ARGS...]", file=sys.stderr)
        return 2
    with postgres() as pg_url, redis() as redis_url:
        env = dict(os.environ, SHARDLINE_TEST_POSTGRES_URL=pg_url, SHARDLINE_TEST_REDIS_URL=redis_url)
        print(f"test stack: postgres {pg_url}  redis {redis_url}", flush=True)
        return subprocess.call(argv, env=env)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))


@contextlib.contextmanager
def fresh_database(postgres_url: str, prefix: str = "test") -> Iterator[str]:
    """A new, empty database on the server of ``postgres_url`` (dropped afterwards): tests that
    migrate or fill a registry get one each, so they never see each other's rows."""
    import uuid

    import psycopg
    from sqlalchemy.engine import make_url

    base = make_url(postgres_url)
    name = f"{prefix}_{uuid.uuid4().hex[:12]}"
    admin = base.set(drivername="postgresql", database="postgres").render_as_string(hide_password=False)
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    try:
        yield base.set(database=name).render_as_string(hide_password=False)
    finally:
        with psycopg.connect(admin, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
