"""The rank processes of a serving worker, for the tests that kill or stop one.

A worker's follower ranks are forked by its fork server (``services.worker.launch``): they are
the server's children, the worker's grandchildren, and share the server's command line."""

from __future__ import annotations

from pathlib import Path

FORK_SERVER = b"multiprocessing.forkserver"


def _children(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            out += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            continue
    return out


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def rank_pids(worker_pid: int) -> list[int]:
    """The follower ranks (1..N-1) of the worker ``worker_pid``, oldest first."""
    servers = [c for c in _children(worker_pid) if FORK_SERVER in _cmdline(c)]
    return sorted(r for s in servers for r in _children(s))


def state(pid: int) -> str:
    """The process's state letter (``T``: stopped), or "" when it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return ""
