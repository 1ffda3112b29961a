"""A PostgreSQL and a Redis of a test's own that it can stop and start again on the same port.

The run's shared servers (tests/stack.py) serve every other test, so a test that restarts its
dependencies starts these instead. They run the same binaries with the same settings as
tests/stack.py; PostgreSQL keeps its data directory across a restart, Redis (no persistence,
like the run's) comes back empty, as a restarted cache does.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import psycopg

from tests.stack import _as_user_prefix, _find_postgres_bin, _wait_for_port, free_port


def _terminate(proc: subprocess.Popen | None, timeout_s: float) -> None:
    if proc is None or proc.poll() is not None:
        return
    proc.terminate()  # SIGTERM: redis-server and postgres (smart shutdown) exit cleanly
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


class RedisServer:
    """redis-server on a free loopback port; ``stop()`` and ``start()`` keep the port."""

    def __init__(self) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server not found: `make test` installs it (apt-get install redis-server)")
        self.binary = binary
        self.port = free_port()
        self.root = Path(tempfile.mkdtemp(prefix="shardline-redis-restart-"))
        self.proc: subprocess.Popen | None = None
        self.url = f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", str(self.root)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        _wait_for_port(self.port, 15, "redis-server", self.proc)

    def stop(self) -> None:
        _terminate(self.proc, 10)

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.root, ignore_errors=True)


class PostgresServer:
    """A PostgreSQL cluster in a temp dir, one database ``shardline_test``; ``stop()`` and
    ``start()`` reuse the data directory and the port."""

    def __init__(self) -> None:
        self.prefix, user = _as_user_prefix()
        self.root = Path(tempfile.mkdtemp(prefix="shardline-pg-restart-"))
        self.data = self.root / "data"
        self.data.mkdir()
        if user is not None:
            entry = pwd.getpwnam(user)
            os.chown(self.root, entry.pw_uid, entry.pw_gid)
            os.chown(self.data, entry.pw_uid, entry.pw_gid)
        subprocess.run(
            [*self.prefix, _find_postgres_bin("initdb"), "-D", str(self.data), "-U", "shardline", "--auth=trust",
             "--no-sync", "-E", "UTF8"],
            check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, cwd=self.root)
        self.port = free_port()
        self.proc: subprocess.Popen | None = None
        self.url = f"postgresql+psycopg://shardline@127.0.0.1:{self.port}/shardline_test"

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [*self.prefix, _find_postgres_bin("postgres"), "-D", str(self.data), "-p", str(self.port),
             "-h", "127.0.0.1", "-k", str(self.root), "-c", "fsync=off", "-c", "synchronous_commit=off",
             "-c", "full_page_writes=off"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=self.root)
        _wait_for_port(self.port, 30, "postgres", self.proc)
        deadline = time.monotonic() + 15
        while True:  # listening comes before accepting sessions (startup, recovery)
            try:
                with psycopg.connect(f"postgresql://shardline@127.0.0.1:{self.port}/postgres",
                                     autocommit=True) as conn:
                    exists = conn.execute("SELECT 1 FROM pg_database WHERE datname = 'shardline_test'").fetchone()
                    if exists is None:
                        conn.execute("CREATE DATABASE shardline_test")
                return
            except psycopg.OperationalError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)

    def stop(self) -> None:
        """A fast shutdown (SIGINT to the postmaster): it ends the clients' sessions, as an
        operator's restart does. SIGTERM would be a smart shutdown, which waits for pooled
        clients that never leave. The signal goes to the postmaster itself (its pid file):
        under runuser the process we started is runuser, which does not pass SIGINT on."""
        if self.proc is None or self.proc.poll() is not None:
            return
        pid_file = self.data / "postmaster.pid"
        with contextlib.suppress(OSError, ValueError, IndexError):
            os.kill(int(pid_file.read_text().split()[0]), signal.SIGINT)
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(OSError, ValueError, IndexError):
                os.kill(int(pid_file.read_text().split()[0]), signal.SIGKILL)
            self.proc.kill()
            self.proc.wait()

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.root, ignore_errors=True)


@contextlib.contextmanager
def redis_server() -> Iterator[RedisServer]:
    server = RedisServer()
    try:
        server.start()
        yield server
    finally:
        server.close()


@contextlib.contextmanager
def postgres_server() -> Iterator[PostgresServer]:
    server = PostgresServer()
    try:
        server.start()
        yield server
    finally:
        server.close()
