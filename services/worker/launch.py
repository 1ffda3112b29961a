"""Launch a replica group's ranks as local processes, or join one started by ``torchrun``.

``run_replica_group(world_size, rank_fn, *args)`` starts ``world_size`` processes (env://
rendezvous on a free loopback port), calls ``rank_fn(rank, world_size, *args)`` in each, and
returns rank 0's result. If any rank dies or raises, the others get until their collective
timeout (plus a grace period) to notice and report, then are killed: the caller gets
:class:`ReplicaGroupFailed` with every rank's message, never a hang.

Ranks are forked from a fork server (one per launching process, started on first use) that has
imported torch and the rank code once: a rank starts in tens of milliseconds instead of the
second or more a fresh interpreter spends importing the same modules. The server is a fresh
interpreter, not a fork of the caller (whose gRPC and OpenMP threads must not be forked), and
runs no tensor op itself. A rank takes the caller's environment as it is at launch, as a
spawned process would, not the server's.

A caller that has started no thread yet and run no tensor op (a worker before its gRPC server
starts, ``score`` and ``generate`` on the command line) is in the state the fork server is in,
with the modules already imported: its ranks (:class:`Followers`, or :func:`run_replica_group`
asked with ``fork``) fork from it directly, which spares the fork server's own start (importing
torch again, about 2 s of CPU).

Under ``torchrun`` (``RANK``/``WORLD_SIZE`` set) the same ``rank_fn`` runs in this process.
"""

from __future__ import annotations

import os
import queue as queue_mod
import signal
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.multiprocessing as mp

from services.common.errors import ShardlineError
from services.common.ports import rendezvous_port
from services.common.process_names import name_rank_process


class ReplicaGroupFailed(RuntimeError):
    """One or more ranks of a replica group failed; ``errors`` maps rank → message."""

    def __init__(self, errors: dict[int, str]) -> None:
        self.errors = dict(sorted(errors.items()))
        lines = [f"rank {rank}: {msg}" for rank, msg in self.errors.items()]
        super().__init__("replica group failed:\n  " + "\n  ".join(lines))


def under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "WORLD_SIZE" in os.environ
                                                   and "MASTER_ADDR" in os.environ)


def threads_per_rank(world_size: int) -> int:
    return max(1, (os.cpu_count() or 1) // world_size)


# what the fork server imports before it forks a rank: torch and every rank entry point
PRELOAD = ["torch", "services.worker.engine.bootstrap", "services.worker.scoring", "services.worker.driver"]


def _context(*, fork: bool = False) -> Any:
    """Fork the ranks from this process when the caller says it has run no tensor op (``fork``)
    and it has started no thread either; else fork them from the fork server."""
    if fork and threading.active_count() == 1:
        return mp.get_context("fork")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)  # takes effect when the server starts (first use)
    return ctx


def _rank_main(rank: int, world_size: int, port: int, results: Any, rank_fn: Callable[..., Any],
               args: tuple[Any, ...], environ: dict[str, str], ignore_signals: bool = False) -> None:
    name_rank_process(rank)
    os.environ.clear()
    os.environ.update(environ)  # the launcher's, not the fork server's (started earlier)
    if ignore_signals:
        # a serving driver's followers stop when the driver says so (or when it is gone: their
        # next collective times out), not when a signal meant for the whole process group lands
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    torch.set_num_threads(threads_per_rank(world_size))
    try:
        result = rank_fn(rank, world_size, *args)
        results.put((rank, "ok", result if rank == 0 else None))
    except BaseException as exc:  # report everything, including KeyboardInterrupt
        detail = f"{type(exc).__name__}: {exc}"
        if not isinstance(exc, (RuntimeError, ValueError, KeyboardInterrupt, ShardlineError)):
            detail += "\n" + traceback.format_exc()
        results.put((rank, "error", detail))
        raise SystemExit(1) from None


def run_replica_group(world_size: int, rank_fn: Callable[..., Any], *args: Any,
                      failure_grace_s: float = 5.0, fork: bool = False) -> Any:
    """Run ``rank_fn`` on every rank; rank 0's return value comes back. ``fork``: the caller
    says it has run no tensor op yet (no OpenMP team to inherit); the ranks are then forked
    from this process itself if it has also started no thread, else from the fork server."""
    if world_size == 1:
        return rank_fn(0, 1, *args)
    if under_torchrun():
        rank = int(os.environ["RANK"])
        return rank_fn(rank, int(os.environ["WORLD_SIZE"]), *args)
    ctx = _context(fork=fork)
    results = ctx.Queue()
    port = rendezvous_port()
    procs = [ctx.Process(target=_rank_main, args=(rank, world_size, port, results, rank_fn, args, dict(os.environ)),
                         name=f"shardline-rank{rank}") for rank in range(world_size)]
    for proc in procs:
        proc.start()
    done: dict[int, Any] = {}
    errors: dict[int, str] = {}
    failed_at: float | None = None
    exited_at: dict[int, float] = {}
    try:
        while len(done) + len(errors) < world_size:
            try:
                rank, kind, payload = results.get(timeout=0.1)
                (done if kind == "ok" else errors)[rank] = payload
            except queue_mod.Empty:
                pass
            now = time.monotonic()
            for rank, proc in enumerate(procs):
                if rank in done or rank in errors or proc.exitcode is None:
                    continue
                exited_at.setdefault(rank, now)
                # a rank that raised reports before exiting; give its message a moment to arrive
                if proc.exitcode < 0 or now - exited_at[rank] > 2.0:
                    errors[rank] = _describe_exit(proc.exitcode)
            if errors and failed_at is None:
                failed_at = now
            if failed_at is not None and now - failed_at > failure_grace_s:
                for rank in range(world_size):
                    if rank not in done and rank not in errors:
                        errors[rank] = f"killed after rank(s) {sorted(errors)} failed (no report within " \
                                       f"{failure_grace_s:g} s)"
                break
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
        for proc in procs:
            proc.join(timeout=5)
        results.close()
    if errors:
        raise ReplicaGroupFailed(errors)
    return done[0]


def _describe_exit(code: int | None) -> str:
    if code is not None and code < 0:
        try:
            return f"process died from signal {signal.Signals(-code).name}"
        except ValueError:
            return f"process died from signal {-code}"
    return f"process exited with code {code} without a report"


class Followers:
    """Ranks 1..N-1 of a group whose rank 0 is this process (a serving driver).

    ``fork``: the caller says it has run no tensor op yet (no OpenMP team to inherit); the ranks
    are then forked from this process itself if it has also started no thread, else from the
    fork server."""

    def __init__(self, world_size: int, rank_fn: Callable[..., Any], *args: Any, fork: bool = False) -> None:
        self.world_size = world_size
        self.port = rendezvous_port()
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(self.port), RANK="0",
                          WORLD_SIZE=str(world_size), LOCAL_RANK="0")
        ctx = _context(fork=fork)
        self.results = ctx.Queue()
        self.procs = [ctx.Process(target=_rank_main,
                                  args=(rank, world_size, self.port, self.results, rank_fn, args, dict(os.environ),
                                        True),
                                  name=f"shardline-rank{rank}", daemon=True)
                      for rank in range(1, world_size)]
        for proc in self.procs:
            proc.start()

    def dead(self) -> list[str]:
        return [f"rank {i + 1}: {_describe_exit(p.exitcode)}" for i, p in enumerate(self.procs)
                if p.exitcode not in (None, 0)]

    def join(self, timeout_s: float = 10.0) -> None:
        deadline = time.monotonic() + timeout_s
        for proc in self.procs:
            proc.join(timeout=max(0.1, deadline - time.monotonic()))
        for proc in self.procs:
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)
