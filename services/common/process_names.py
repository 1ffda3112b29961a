"""The names of a replica group's rank processes on this machine.

A rank forked from its worker shares the worker's command line, so each rank sets the kernel's
name of its process (``/proc/PID/comm``, what ``ps -o comm`` and ``top`` show; 15 bytes) to
``shardline-rankN``; tools and tests that look for a worker's ranks read it back.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

PR_SET_NAME = 15  # prctl(2)
RANK_PROCESS_NAME = "shardline-rank"


def name_rank_process(rank: int) -> None:
    """Name this process after its rank (cosmetic where prctl is missing: not Linux)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_NAME, ctypes.c_char_p(f"{RANK_PROCESS_NAME}{rank}".encode()[:15]), 0, 0, 0)
    except (OSError, AttributeError):
        pass


def rank_of_process(pid: int) -> int | None:
    """The rank process ``pid`` runs, read from its name; None when it is not a rank (or is gone)."""
    try:
        name = Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return None
    number = name.removeprefix(RANK_PROCESS_NAME)
    return int(number) if number != name and number.isdigit() else None
