"""Alert rules: each collective failure mode, how it shows and what to do, from collective telemetry.

- all-reduce timeout in a TP group (wait() exceeds the timeout): any event with ``timed_out``
  -> COLLECTIVE_TIMEOUT; every rank ``unhealthy`` in the health store, the group drained.
- NVLink degrading to PCIe (p99 spike without a hang): a rank's all-reduce p99 above k x the
  group's baseline for N windows -> SLOW_RANK naming the rank; the group ``degraded``.
- InfiniBand flap at a pipeline boundary (send/recv timeout; the recovery: retry once, drain the
  replica if it fails again). The coordinator owns the retry: a send/recv whose first wait runs
  out is waited on once more, and each wait is its own event. So a ``send``/``recv`` event with
  ``timed_out`` is a flap -> STAGE_LINK_FLAP naming the rank, the group ``degraded`` (it goes on
  serving); if that rank's next event is another timed-out send/recv (the retry ran out too) ->
  STAGE_LINK_FAILURE; ranks ``unhealthy``, the group drained. Any event of that rank that did not
  time out (the retry completing, the next step's ops) ends the streak. A group whose flapped
  ranks have had no stage-link timeout for ``sustain_windows`` windows gets STAGE_LINK_FLAP
  alerts with ``healthy``.
- a lost peer: its process killed (the transport closes the connection and the op fails before
  its timeout), or its node hung (it stopped reporting to the health store while a stage-boundary
  op waited out its first timeout, so the retry is not waited for). The event has ``peer_lost``
  (and ``timed_out``) set -> COLLECTIVE_TIMEOUT (an all-reduce, broadcast, ...) or
  STAGE_LINK_FAILURE (a send/recv) at once, naming the op's rank; every rank ``unhealthy``.

Any other ``timed_out`` event means the op finally failed, so one is enough. The group is
poisoned from then on (a timed-out group is never reused), so each kind of failure alert fires
once per group; a flap alerts once per rank until the group recovers.

Slow ranks. Per window, per TP group (the ranks of one pipeline stage, read from the gpu_id's
``pp<s>-tp<r>``), each rank's all-reduce p99 is compared with the group's baseline
``B = min(learned baseline, lowest p99 among the group's ranks this window)``. The learned
baseline is the median of the group's pooled p99 over its first ``baseline_windows`` windows,
then an exponential average of windows where nothing was flagged; taking the minimum with the
best rank of the same window keeps a rank that is slow from the very start detectable. A rank
is *elevated* when ``p99 > k * B`` and ``p99 - B > min_excess_ms``. Who is to blame:

- An all-reduce finishes for everyone when the last rank arrives, so a straggler (a slow GPU, a
  rank sleeping before its collective) shows as long waits on its *peers* and a short wait on
  itself. When every rank of a TP group but one is elevated, the one left out is the slow rank.
- When every rank is elevated but one still waits far less than all its peers (each of them
  elevated against *its* p99: on a busy host the straggler's own waits rise too), it is the slow rank.
- Otherwise (every rank elevated alike: a slow link; or a single elevated rank among three or
  more) the elevated rank with the highest p99 is named.

The same rank named in ``sustain_windows`` consecutive windows with traffic raises SLOW_RANK and
moves the group to ``degraded``; once it has been clean for as many windows, a SLOW_RANK alert
with ``healthy`` says it recovered.
"""

from __future__ import annotations

import enum
import re
import statistics
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from services.common.group_status import GroupStatus
from services.telemetry.sketch import LogHistogram

STAGE_LINK_OPS = frozenset({"send", "recv"})
_GPU_COORDS = re.compile(r"pp(\d+)-tp(\d+)$")


class AlertKind(enum.Enum):
    COLLECTIVE_TIMEOUT = "collective_timeout"
    SLOW_RANK = "slow_rank"
    STAGE_LINK_FAILURE = "stage_link_failure"
    STAGE_LINK_FLAP = "stage_link_flap"
    # raised outside telemetry by the quality checks (TelemetryService.RaiseAlert)
    SHADOW_DIVERGENCE = "shadow_divergence"
    QUALITY_DRIFT = "quality_drift"
    # raised by the fleet controller: a group it started failed before serving
    PROVISIONING_FAILED = "provisioning_failed"


# what TelemetryService.RaiseAlert accepts: the kinds no telemetry rule decides
RAISED_KINDS = frozenset({AlertKind.SHADOW_DIVERGENCE, AlertKind.QUALITY_DRIFT, AlertKind.PROVISIONING_FAILED})


@dataclass(frozen=True)
class Alert:
    kind: AlertKind
    replica_group_id: str
    gpu_id: str
    op_type: str
    new_status: GroupStatus
    message: str
    timestamp_ms: int
    observed_p99_ms: float = 0.0
    baseline_p99_ms: float = 0.0
    perplexity_delta_pct: float = 0.0  # the quality kinds
    threshold_pct: float = 0.0
    reference: str = ""
    # every rank of the group telemetry has heard from (the health store marks them all)
    group_gpu_ids: tuple[str, ...] = ()


@dataclass(frozen=True)
class RuleConfig:
    slow_k: float = 3.0
    sustain_windows: int = 3
    baseline_windows: int = 3
    min_events: int = 10  # a rank's TP collectives in a window before its p99 counts
    min_excess_ms: float = 0.5  # p99 - baseline must also exceed this (CPU scheduling noise)
    baseline_ewma: float = 0.1
    # the collectives a TP group runs at every layer, whose waits give a slow rank away: the
    # row-parallel layers' all-gathers of their fixed k-chunks in the layout-invariant numerics
    # (and the logits'), their all-reduces per-layout (and the embedding's)
    slow_ops: tuple[str, ...] = ("all_reduce", "all_gather")

    @property
    def slow_op(self) -> str:
        """The slow ops as one name, for alerts and their messages."""
        return "/".join(self.slow_ops)

    def __post_init__(self) -> None:
        if self.slow_k <= 1.0:
            raise ValueError(f"slow_k must be > 1, got {self.slow_k}")
        if self.sustain_windows < 1 or self.baseline_windows < 1:
            raise ValueError(f"sustain_windows and baseline_windows must be >= 1, got "
                             f"{self.sustain_windows}, {self.baseline_windows}")
        if self.min_events < 1:
            raise ValueError(f"min_events must be >= 1, got {self.min_events}")


def gpu_coords(gpu_id: str) -> tuple[int, int] | None:
    """``rg-1:pp1-tp0`` -> (pp_stage=1, tp_rank=0); None for an id in another format."""
    m = _GPU_COORDS.search(gpu_id)
    return (int(m.group(1)), int(m.group(2))) if m else None


@dataclass
class _SlowState:
    warmup: list[float] = field(default_factory=list)
    baseline_ms: float | None = None
    streak_gpu: str | None = None
    streak: int = 0
    clean: int = 0
    degraded_gpu: str | None = None


@dataclass(frozen=True)
class _Verdict:
    gpu_id: str
    observed_ms: float  # the elevated p99 that gave it away
    reference_ms: float
    straggler: bool


class RuleEngine:
    """Stateful rules per group. Not thread-safe: the pipeline calls it under its lock."""

    def __init__(self, config: RuleConfig | None = None, *, window_s: float = 10.0) -> None:
        self.config = config or RuleConfig()
        self.window_s = window_s
        self._fired: set[tuple[str, AlertKind]] = set()
        self._slow: dict[str, _SlowState] = {}
        # group -> gpu_id -> (its last stage-link timeout (ms), the op)
        self._flapped: dict[str, dict[str, tuple[int, str]]] = {}
        # (group, gpu_id) -> timed-out send/recv events in a row (until any event that did not time out)
        self._link_streak: dict[tuple[str, str], int] = {}

    # -- timeouts ------------------------------------------------------------------------------
    def on_timeout(self, event, *, group_gpu_ids: Iterable[str], silent_gpu_ids: Iterable[str] = ()) -> Alert | None:
        """An event with ``timed_out`` set; returns the alert the first time per group and kind
        (a stage-link flap: the first time per rank until the group recovers). Call it, and
        :meth:`on_completed`, in each rank's event order."""
        stage_link = event.op_type in STAGE_LINK_OPS
        if stage_link and not event.peer_lost:  # a lost peer is final: no retry, no flap
            key = (event.replica_group_id, event.gpu_id)
            self._link_streak[key] = self._link_streak.get(key, 0) + 1
            if self._link_streak[key] == 1:
                return self._on_flap(event)
        kind = AlertKind.STAGE_LINK_FAILURE if stage_link else AlertKind.COLLECTIVE_TIMEOUT
        if (event.replica_group_id, kind) in self._fired:
            return None
        self._fired.add((event.replica_group_id, kind))
        silent = sorted(silent_gpu_ids)
        hint = f"; not heard from since it began: {', '.join(silent)}" if silent else ""
        if event.peer_lost:
            where = " at a pipeline stage boundary" if stage_link else ""
            message = (f"{event.op_type}{where} failed on {event.gpu_id} after {event.duration_ms / 1e3:.2f} s: its "
                       f"peer is gone (a closed connection, or a node that stopped reporting): replica group "
                       f"{event.replica_group_id} is unhealthy{hint}")
            status = GroupStatus.UNHEALTHY
        elif stage_link:
            message = (f"{event.op_type} at a pipeline stage boundary timed out again on {event.gpu_id} after "
                       f"the coordinator's retry ({event.duration_ms / 1e3:.2f} s): draining replica group "
                       f"{event.replica_group_id}{hint}")
            status = GroupStatus.DRAINING
        else:
            message = (f"{event.op_type} timed out on {event.gpu_id} after {event.duration_ms / 1e3:.2f} s "
                       f"(group of {event.group_size}): replica group {event.replica_group_id} is "
                       f"unhealthy{hint}")
            status = GroupStatus.UNHEALTHY
        return Alert(kind, event.replica_group_id, event.gpu_id, event.op_type, status, message,
                     int(event.timestamp_ms), group_gpu_ids=tuple(sorted(group_gpu_ids)))

    def has_failed(self, replica_group_id: str) -> bool:
        return any(group == replica_group_id for group, _ in self._fired)

    @property
    def links_pending(self) -> bool:
        """Some rank's last event was a timed-out send/recv: its next event settles the retry."""
        return bool(self._link_streak)

    def on_completed(self, event) -> None:
        """An event without ``timed_out``: its rank's stage-link streak (if any) is over."""
        if self._link_streak:
            self._link_streak.pop((event.replica_group_id, event.gpu_id), None)

    def _on_flap(self, event) -> Alert | None:
        group, gpu = event.replica_group_id, event.gpu_id
        if self.has_failed(group):
            return None
        flapped = self._flapped.setdefault(group, {})
        first = gpu not in flapped
        flapped[gpu] = (max(flapped.get(gpu, (0, ""))[0], int(event.timestamp_ms)), event.op_type)
        if not first:
            return None
        message = (f"{event.op_type} at a pipeline stage boundary timed out on {gpu} after "
                   f"{event.duration_ms / 1e3:.2f} s; the coordinator retries it once (a second timeout in "
                   f"a row drains the group): replica group {group} degraded")
        return Alert(AlertKind.STAGE_LINK_FLAP, group, gpu, event.op_type, GroupStatus.DEGRADED, message,
                     int(event.timestamp_ms))

    def on_tick(self, now_ms: int) -> list[Alert]:
        """A group's flapped ranks recover together once none of them has had a stage-link
        timeout for ``sustain_windows`` windows (not while the group is failed, nor while a slow rank
        keeps it degraded: the group's status is one value)."""
        quiet_ms = self.config.sustain_windows * self.window_s * 1e3
        alerts = []
        for group, flapped in list(self._flapped.items()):
            if self.has_failed(group):
                del self._flapped[group]
                continue
            slow = self._slow.get(group)
            if slow is not None and slow.degraded_gpu is not None:
                continue
            if now_ms - max(last_ms for last_ms, _ in flapped.values()) < quiet_ms:
                continue
            del self._flapped[group]
            for gpu, (_, op) in sorted(flapped.items()):
                alerts.append(Alert(AlertKind.STAGE_LINK_FLAP, group, gpu, op, GroupStatus.HEALTHY,
                                    f"{gpu} recovered: no stage-link timeout for {quiet_ms / 1e3:g} s: replica "
                                    f"group {group} healthy", now_ms))
        return alerts

    # -- slow ranks ----------------------------------------------------------------------------
    def on_window_closed(self, replica_group_id: str, window_end_ms: int,
                         stats: Mapping[str, LogHistogram]) -> Alert | None:
        """Evaluate one closed window: ``stats`` maps gpu_id to its ``slow_ops`` durations."""
        cfg = self.config
        hists = {gpu: h for gpu, h in stats.items() if h.count >= cfg.min_events}
        if not hists or self.has_failed(replica_group_id):
            return None
        state = self._slow.setdefault(replica_group_id, _SlowState())
        p99 = {gpu: h.quantile(0.99) for gpu, h in hists.items()}
        pooled = LogHistogram(next(iter(hists.values())).alpha)
        for h in hists.values():
            pooled.merge(h)
        reference = min(p99.values())
        if state.baseline_ms is not None:
            reference = min(reference, state.baseline_ms)
        verdict = self._blame(p99, reference) if len(p99) > 1 else None
        self._learn(state, pooled.quantile(0.99), flagged=verdict is not None)
        return self._track(replica_group_id, state, verdict, window_end_ms)

    def _blame(self, p99: dict[str, float], reference: float) -> _Verdict | None:
        by_stage: dict[object, list[str]] = {}
        for gpu in p99:
            coords = gpu_coords(gpu)
            by_stage.setdefault(coords[0] if coords else None, []).append(gpu)
        worst: _Verdict | None = None
        for members in by_stage.values():
            elevated = [g for g in members if self._elevated(p99[g], reference)]
            if not elevated:
                continue
            calm = [g for g in members if g not in elevated]
            top = max(elevated, key=p99.__getitem__)
            fastest = min(members, key=p99.__getitem__)
            if len(members) >= 2 and len(calm) == 1:
                verdict = _Verdict(calm[0], p99[top], reference, straggler=True)
            elif len(members) >= 2 and not calm and all(self._elevated(p99[g], p99[fastest])
                                                        for g in members if g != fastest):
                # every rank is elevated, but one waits far less than all its peers: still a straggler
                # (on a busy host its own waits on the others rise above the baseline too)
                verdict = _Verdict(fastest, p99[top], reference, straggler=True)
            else:
                verdict = _Verdict(top, p99[top], reference, straggler=False)
            if worst is None or verdict.observed_ms > worst.observed_ms:
                worst = verdict
        return worst

    def _elevated(self, p99_ms: float, reference_ms: float) -> bool:
        return p99_ms > self.config.slow_k * reference_ms and p99_ms - reference_ms > self.config.min_excess_ms

    def _learn(self, state: _SlowState, pooled_p99: float, *, flagged: bool) -> None:
        cfg = self.config
        if state.baseline_ms is None:
            state.warmup.append(pooled_p99)
            if len(state.warmup) >= cfg.baseline_windows:
                state.baseline_ms = statistics.median(state.warmup)
        elif not flagged:
            state.baseline_ms += cfg.baseline_ewma * (pooled_p99 - state.baseline_ms)

    def _track(self, group: str, state: _SlowState, verdict: _Verdict | None, now_ms: int) -> Alert | None:
        cfg = self.config
        if verdict is None:
            state.streak_gpu, state.streak = None, 0
            if state.degraded_gpu is None:
                return None
            state.clean += 1
            if state.clean < cfg.sustain_windows:
                return None
            gpu, state.degraded_gpu, state.clean = state.degraded_gpu, None, 0
            return Alert(AlertKind.SLOW_RANK, group, gpu, cfg.slow_op, GroupStatus.HEALTHY,
                         f"{gpu} recovered: {cfg.slow_op} p99 within {cfg.slow_k:g}x of the baseline for "
                         f"{cfg.sustain_windows} windows", now_ms, baseline_p99_ms=state.baseline_ms or 0.0)
        state.clean = 0
        if verdict.gpu_id == state.streak_gpu:
            state.streak += 1
        else:
            state.streak_gpu, state.streak = verdict.gpu_id, 1
        if state.streak < cfg.sustain_windows or state.degraded_gpu == verdict.gpu_id:
            return None
        state.degraded_gpu = verdict.gpu_id
        why = (f"its TP peers wait on it: their {cfg.slow_op} p99 is {verdict.observed_ms:.2f} ms" if verdict.straggler
               else f"its {cfg.slow_op} p99 is {verdict.observed_ms:.2f} ms")
        message = (f"{verdict.gpu_id} is slow: {why}, over {cfg.slow_k:g}x the group's baseline of "
                   f"{verdict.reference_ms:.2f} ms for {state.streak} consecutive {self.window_s:g} s windows: "
                   f"replica group {group} degraded")
        return Alert(AlertKind.SLOW_RANK, group, verdict.gpu_id, cfg.slow_op, GroupStatus.DEGRADED, message, now_ms,
                     observed_p99_ms=verdict.observed_ms, baseline_p99_ms=verdict.reference_ms)
