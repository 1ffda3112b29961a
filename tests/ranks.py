"""The rank processes of a serving worker, for the tests that kill or stop one.

A worker's follower ranks are forked from the worker itself, or from its fork server
(``services.worker.launch``): its children or grandchildren, named ``shardline-rankN``."""

from __future__ import annotations

from pathlib import Path

from services.common.process_names import rank_of_process


def _children(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            out += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            continue
    return out


def rank_pids(worker_pid: int) -> list[int]:
    """The follower ranks (1..N-1) of the worker ``worker_pid``, by rank."""
    near = _children(worker_pid)
    ranks = {p: rank for p in near + [g for c in near for g in _children(c)]
             if (rank := rank_of_process(p)) is not None}
    return sorted(ranks, key=ranks.__getitem__)


def state(pid: int) -> str:
    """The process's state letter (``T``: stopped), or "" when it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return ""


# The collective timeout of the in-process replica groups whose tests check numbers, not how a
# hang is found (the default, 2 s, is for finding one). Three ranks on 2 cores beside another
# worker's test, on a slow host, left one rank's step more than 2 s behind its peers' in two
# fresh-clone runs of the whole suite on the AVX2 EPYC (2026-12-07, a TP3 SmolLM2 scoring).
NUMERICS_COLLECTIVE_TIMEOUT_S = 30.0
