"""The coordinator: every collective and point-to-point op of a rank goes through here.

Each op is issued with ``async_op=True`` and waited on with a timeout, so a dead or hung peer
surfaces as :class:`ShardGroupUnhealthy` within the timeout instead of a silent hang (NCCL under a
dead peer never returns; gloo fails fast on a closed connection but only times out on a stopped
one). Every op records a :class:`CollectiveEvent`. After the first failure the coordinator refuses
every later call: a group that timed out is poisoned and must be torn down, never reused.

Stage-boundary send/recv get one retry (the recovery for an InfiniBand link flap: retry once, drain the
replica if it fails again): when the first timeout runs out, the op is waited on for one more
timeout period before the group is failed. A gloo work cannot be waited on again once its
``wait(timeout)`` gave up (gloo closes the pair: "Application timeout caused pair closure"), so
the retry is one wait of twice the timeout, split afterwards into the two attempts, each its own
event: the first wait (``timed_out``, duration = the timeout), then the retry (its own duration,
``timed_out`` only if it ran out too). Telemetry reads one timed-out send/recv as a link flap and
two in a row as a failed link. A dead peer (closed connection) is not retried, and neither is a
peer known to be lost: while a stage-boundary op waits out its retry, another thread that learns
the peer's node stopped reporting (the driver's node watchdog, services/worker/node_health.py) may
:meth:`Coordinator.give_up` on it, failing the group then instead of at the retry's end. Both
record the op as ``peer_lost``.

Groups of one rank skip communication entirely (Megatron's convention), so TP=1 / PP=1 code paths
make no collective calls and record no events.
"""

from __future__ import annotations

import logging
import pickle
import threading
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from services.common.collective_events import CollectiveEvent, EventSink, RingBufferSink, rank_gpu_id, tp_communicator
from services.modeling.parallel.faults import FaultInjector
from services.modeling.parallel.groups import ParallelGroups

DEFAULT_TIMEOUT_S = 2.0
STAGE_LINK_OPS = frozenset({"send", "recv"})  # retried once before the group is failed

log = logging.getLogger(__name__)


class ShardGroupUnhealthy(RuntimeError):
    """A collective in this replica group failed or timed out; the group must be replaced."""

    def __init__(self, replica_group_id: str, gpu_id: str, op: str, detail: str) -> None:
        self.replica_group_id = replica_group_id
        self.gpu_id = gpu_id
        self.op = op
        super().__init__(f"replica group {replica_group_id} is unhealthy: {op} on {gpu_id} {detail}")


class Coordinator:
    """Owns this rank's collectives, their timeouts and their telemetry."""

    def __init__(self, groups: ParallelGroups, *, replica_group_id: str = "local",
                 timeout_s: float = DEFAULT_TIMEOUT_S, sink: EventSink | None = None,
                 faults: FaultInjector | None = None) -> None:
        self.groups = groups
        self.replica_group_id = replica_group_id
        self.gpu_id = rank_gpu_id(replica_group_id, groups.pp_stage, groups.tp_rank)
        self.timeout_s = timeout_s
        self.sink: EventSink = sink if sink is not None else RingBufferSink()
        self.faults = faults if faults is not None else FaultInjector(groups.global_rank)
        self.failure: ShardGroupUnhealthy | None = None
        self._pending: tuple[list, tuple] | None = None  # a deferred send: (works, tensors kept alive)
        # the stage-boundary op being waited on: (op, bytes, perf_counter and wall time at issue);
        # guarded by _lock, with ``failure``, against give_up from another thread
        self._waiting: tuple[str, int, float, float] | None = None
        self._lock = threading.Lock()
        # ops issued per communicator: every member issues the same ones in the same order, so
        # telemetry can tell which peer never finished a timed-out op by its number
        self._tp_comm = tp_communicator(groups.pp_stage)
        self._seq: dict[str, int] = {}

    @property
    def healthy(self) -> bool:
        return self.failure is None

    # -- the one place that waits ------------------------------------------------------------
    def _run(self, op: str, nbytes: int, group_size: int, start_work, timeout_s: float | None,
             communicator: str = "") -> None:
        """``communicator``: where a collective runs, to number it ("" for point-to-point ops)."""
        if self.failure is not None:
            raise ShardGroupUnhealthy(self.replica_group_id, self.gpu_id, op,
                                      f"refused: group already failed ({self.failure.op})")
        seq = 0
        if communicator:
            seq = self._seq[communicator] = self._seq.get(communicator, 0) + 1
        if self.faults:
            self.faults.before(op)
        timeout = self.timeout_s if timeout_s is None else timeout_s
        retries = op in STAGE_LINK_OPS
        budget = timeout * (2 if retries else 1)  # the first wait, then the retry's
        wall0 = time.time()
        t0 = time.perf_counter()
        timed_out, failed = False, None
        if retries:
            self._waiting = (op, nbytes, t0, wall0)
        try:
            works = start_work()
            for work in works if isinstance(works, list) else [works]:
                # gloo reads a timeout under 1 ms as none at all (the group default): never pass one
                left = max(1e-3, budget - (time.perf_counter() - t0))
                if work.wait(timeout=timedelta(seconds=left)) is False:
                    timed_out = True
                    break
        except RuntimeError as exc:  # gloo: timeout or closed connection; nccl: abort
            text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            timed_out = "timeout" in text.lower() or "timed out" in text.lower()
            failed = text
        elapsed = time.perf_counter() - t0
        if retries:
            with self._lock:
                self._waiting = None
                if self.failure is not None:  # given up on meanwhile (recorded then): the group has failed
                    raise self.failure
        broken = timed_out or failed is not None
        closed = failed is not None and not timed_out  # the transport gave up first: a peer is gone
        if retries and elapsed > timeout:
            # the first wait ran out: that attempt is a timed-out event of its own, the retry another
            self._record(op, nbytes, group_size, timeout, wall0 + timeout, timed_out=True)
            self._record(op, nbytes, group_size, elapsed - timeout, wall0 + elapsed, timed_out=broken,
                         peer_lost=closed)
            if not broken:
                log.warning("%s on %s timed out after %g s; its retry completed (%.2f s in all)",
                            op, self.gpu_id, timeout, elapsed)
        else:
            self._record(op, nbytes, group_size, elapsed, wall0 + elapsed, timed_out=broken, peer_lost=closed,
                         seq=seq, communicator=communicator)
        if broken:
            what = f"timed out after {timeout:g} s" if timed_out else "failed"
            if timed_out and retries:
                what += ", and again after its retry"
            detail = what + (f" ({failed})" if failed else "") + f" after waiting {elapsed:.2f} s"
            self.failure = ShardGroupUnhealthy(self.replica_group_id, self.gpu_id, op, detail)
            raise self.failure

    def in_retry(self) -> bool:
        """Whether a stage-boundary op has waited past its first timeout: it is in its retry."""
        waiting = self._waiting
        return waiting is not None and time.perf_counter() - waiting[2] > self.timeout_s

    def give_up(self, reason: str) -> ShardGroupUnhealthy | None:
        """From another thread: fail the group now instead of waiting out the retry of the
        stage-boundary op this rank is blocked in, because its peer is known to be lost
        (``reason`` says how). Records the op as ``peer_lost``; the blocked call raises the
        failure when its wait ends. Returns the failure, or None when no op is in its retry
        (it completed, or the group had failed already)."""
        with self._lock:
            waiting = self._waiting
            if waiting is None or self.failure is not None or not self.in_retry():
                return None
            op, nbytes, t0, wall0 = waiting
            elapsed = time.perf_counter() - t0
            self._record(op, nbytes, 2, elapsed, wall0 + elapsed, timed_out=True, peer_lost=True)
            self.failure = ShardGroupUnhealthy(
                self.replica_group_id, self.gpu_id, op,
                f"timed out after {self.timeout_s:g} s and was not retried: {reason} (gave up after {elapsed:.2f} s)")
            return self.failure

    def _record(self, op: str, nbytes: int, group_size: int, duration_s: float, end_s: float, *,
                timed_out: bool, peer_lost: bool = False, seq: int = 0, communicator: str = "") -> None:
        self.sink.record(CollectiveEvent(
            replica_group_id=self.replica_group_id, gpu_id=self.gpu_id, op_type=op, bytes=nbytes,
            duration_ms=duration_s * 1e3, group_size=group_size, timestamp_ms=int(end_s * 1e3),
            timed_out=timed_out, peer_lost=peer_lost, seq=seq, communicator=communicator))

    # -- tensor parallel ---------------------------------------------------------------------
    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` in place across the TP group."""
        if self.groups.tp_degree == 1:
            return tensor
        self._run("all_reduce", _nbytes(tensor), self.groups.tp_degree,
                  lambda: dist.all_reduce(tensor, group=self.groups.tp_group, async_op=True), None, self._tp_comm)
        return tensor

    def all_gather(self, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Concatenate every TP rank's ``tensor`` along ``dim`` (rank order)."""
        if self.groups.tp_degree == 1:
            return tensor
        tensor = tensor.contiguous()
        parts = [torch.empty_like(tensor) for _ in range(self.groups.tp_degree)]
        self._run("all_gather", _nbytes(tensor) * self.groups.tp_degree, self.groups.tp_degree,
                  lambda: dist.all_gather(parts, tensor, group=self.groups.tp_group, async_op=True), None,
                  self._tp_comm)
        return torch.cat(parts, dim=dim)

    # -- pipeline parallel -------------------------------------------------------------------
    def send(self, tensor: torch.Tensor, dst_stage: int, *, timeout_s: float | None = None) -> None:
        """Send to the rank with the same tp_rank in ``dst_stage``."""
        dst = self.groups.rank_of(dst_stage, self.groups.tp_rank)
        tensor = tensor.contiguous()
        self._run("send", _nbytes(tensor), 2,
                  lambda: dist.isend(tensor, dst=dst, group=self.groups.pp_group), timeout_s)

    def recv(self, shape: tuple[int, ...], dtype: torch.dtype, src_stage: int, *,
             timeout_s: float | None = None) -> torch.Tensor:
        src = self.groups.rank_of(src_stage, self.groups.tp_rank)
        out = torch.empty(shape, dtype=dtype, device=self.groups.device)
        self._run("recv", _nbytes(out), 2,
                  lambda: dist.irecv(out, src=src, group=self.groups.pp_group), timeout_s)
        return out

    # -- control messages (gloo, CPU tensors) ------------------------------------------------
    def broadcast_object(self, obj: Any = None, *, src: int = 0, timeout_s: float | None = None) -> Any:
        """Broadcast a picklable object from global rank ``src`` to every rank of the group."""
        if self.groups.world_size == 1:
            return obj
        group = self.groups.control_group
        is_src = self.groups.global_rank == src
        payload = pickle.dumps(obj) if is_src else b""
        size = torch.tensor([len(payload)], dtype=torch.int64)
        self._run("broadcast", 8, self.groups.world_size,
                  lambda: dist.broadcast(size, src=src, group=group, async_op=True), timeout_s, "control")
        buf = (torch.frombuffer(bytearray(payload), dtype=torch.uint8) if is_src
               else torch.empty(int(size.item()), dtype=torch.uint8))
        self._run("broadcast", buf.numel(), self.groups.world_size,
                  lambda: dist.broadcast(buf, src=src, group=group, async_op=True), timeout_s, "control")
        return obj if is_src else pickle.loads(buf.numpy().tobytes())

    def send_object(self, obj: Any, dst: int, *, timeout_s: float | None = None, deferred: bool = False) -> None:
        """Point-to-point message to global rank ``dst`` on the result group (sampled tokens
        from the last stage to the driver).

        ``deferred``: issue the send and return; it is waited for (with the timeout, recorded like
        any op) before the next send or at :meth:`flush`. Gloo completes a send only once the peer
        posts the matching receive, and with PP micro-batches the driver receives result k only
        after broadcasting plan k+1 — waiting here would deadlock the pipeline.
        """
        self.flush(timeout_s=timeout_s)
        payload = pickle.dumps(obj)
        size = torch.tensor([len(payload)], dtype=torch.int64)
        buf = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        group = self.groups.result_group

        def start():
            return [dist.isend(size, dst=dst, group=group), dist.isend(buf, dst=dst, group=group)]

        if not deferred:
            self._run("send", 8 + buf.numel(), 2, start, timeout_s)
            return
        if self.failure is not None:
            raise ShardGroupUnhealthy(self.replica_group_id, self.gpu_id, "send",
                                      f"refused: group already failed ({self.failure.op})")
        self._pending = (start(), (size, buf))

    def flush(self, *, timeout_s: float | None = None) -> None:
        """Wait for a deferred send (see :meth:`send_object`)."""
        pending, self._pending = self._pending, None
        if pending is not None:
            works, tensors = pending
            self._run("send", sum(t.numel() * t.element_size() for t in tensors), 2, lambda: works, timeout_s)

    def recv_object(self, src: int, *, timeout_s: float | None = None) -> Any:
        group = self.groups.result_group
        size = torch.empty(1, dtype=torch.int64)
        self._run("recv", 8, 2, lambda: dist.irecv(size, src=src, group=group), timeout_s)
        buf = torch.empty(int(size.item()), dtype=torch.uint8)
        self._run("recv", buf.numel(), 2, lambda: dist.irecv(buf, src=src, group=group), timeout_s)
        return pickle.loads(buf.numpy().tobytes())

    def barrier(self, *, timeout_s: float | None = None) -> None:
        """All ranks of the replica group meet (e.g. after loading, whose time differs by rank)."""
        if self.groups.world_size == 1:
            return
        token = torch.zeros(1)
        self._run("barrier", 4, self.groups.world_size,
                  lambda: dist.all_reduce(token, group=self.groups.control_group, async_op=True), timeout_s,
                  "control")


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()
