"""The telemetry service's domain: ingest into windows, run the rules, publish alerts.

``TelemetryPipeline.ingest`` is the hot path (one lock, one pass over the batch). Timeouts are
judged as they arrive; slow-rank rules run when a window closes, which a ticker thread notices
``close_grace_s`` after the window's end (time for the ranks' last batches to arrive). Alerts go
to every subscriber of :meth:`subscribe` (the Alerts RPC) and to the effect worker, which writes
the health store and the registry off the ingest path.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

from services.common.collective_events import communicator_members
from services.telemetry.effects import EffectWorker, GroupStatusEffects
from services.telemetry.rules import RAISED_KINDS, Alert, AlertKind, RuleConfig, RuleEngine
from services.telemetry.sketch import LogHistogram
from services.telemetry.windows import EventLike, Series, SeriesTotals, WindowConfig, WindowStore, WindowSummary

log = logging.getLogger(__name__)

ALERT_HISTORY = 256
# For a rank that does not share the timed-out op's communicator (another stage, or an op with no
# number): one whose last event ended this soon after the op was issued still counts as not heard
# from since. Ranks leave a collective together, and the next one is issued a fraction of a
# millisecond later (less than the whole-ms timestamps' resolution) on a small model.
SAME_ROUND_MS = 20.0


@dataclass(frozen=True)
class PipelineConfig:
    windows: WindowConfig = field(default_factory=WindowConfig)
    rules: RuleConfig = field(default_factory=RuleConfig)
    close_grace_s: float = 0.5  # a window is judged this long after it ends
    forget_after_windows: int = 60  # series silent this long are dropped (replaced groups)


class AlertSubscription:
    """Alerts for one subscriber, in order. ``get`` returns None on timeout or once closed."""

    def __init__(self, replica_group_id: str, on_close: Callable[[AlertSubscription], None]) -> None:
        self.replica_group_id = replica_group_id
        self._queue: queue.SimpleQueue[Alert | None] = queue.SimpleQueue()
        self._on_close = on_close
        self.closed = False

    def wants(self, alert: Alert) -> bool:
        return not self.replica_group_id or alert.replica_group_id == self.replica_group_id

    def put(self, alert: Alert | None) -> None:
        self._queue.put(alert)

    def get(self, timeout_s: float) -> Alert | None:
        try:
            return self._queue.get(timeout=timeout_s)
        except queue.Empty:
            return None

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self._on_close(self)
            self._queue.put(None)


class TelemetryPipeline:
    def __init__(self, config: PipelineConfig | None = None, *, effects: GroupStatusEffects | None = None,
                 clock_ms: Callable[[], int] | None = None) -> None:
        self.config = config or PipelineConfig()
        self._clock_ms = clock_ms or (lambda: int(time.time() * 1e3))
        self.store = WindowStore(self.config.windows, now_ms=self._clock_ms())
        self.rules = RuleEngine(self.config.rules, window_s=self.config.windows.window_s)
        self.lock = threading.Lock()
        self.dropped_total = 0  # reported by senders
        self.alerts_fired = 0
        self.alerts_by_kind: dict[str, int] = {}  # AlertKind value -> alerts raised
        self._judged: dict[str, int] = {}  # group -> last window index the slow-rank rule saw
        self._history: collections.deque[Alert] = collections.deque(maxlen=ALERT_HISTORY)
        self._subscribers: list[AlertSubscription] = []
        self._nodes: dict[tuple[str, str], str] = {}  # (group, gpu_id) -> the node its events came from
        self._effects = EffectWorker(effects) if effects is not None else None
        self._stop = threading.Event()
        self._ticker: threading.Thread | None = None

    # -- lifecycle -------------------------------------------------------------------------
    def start(self) -> TelemetryPipeline:
        period = max(0.05, min(1.0, self.config.windows.window_s / 4))
        self._ticker = threading.Thread(target=self._tick_loop, args=(period,), name="telemetry-windows", daemon=True)
        self._ticker.start()
        return self

    def close(self) -> None:
        self._stop.set()
        if self._ticker is not None:
            self._ticker.join(timeout=5)
        for sub in list(self._subscribers):
            sub.close()
        if self._effects is not None:
            self._effects.close()

    def _tick_loop(self, period_s: float) -> None:
        while not self._stop.wait(period_s):
            try:
                self.tick()
            except Exception:  # a bug in a rule must not stop the clock
                log.exception("telemetry window tick failed")

    # -- ingest ----------------------------------------------------------------------------
    def ingest(self, events: Iterable[EventLike], *, dropped: int = 0, node_id: str = "") -> int:
        """Add one batch; returns the events accepted. Timed-out events are judged here, in each
        rank's order (the stage-link rule counts timeouts in a row). ``node_id``: the sender's
        node, remembered for the ranks of the batch so that an alert can name where a rank runs."""
        if isinstance(events, Iterator):
            events = list(events)  # read twice when there is something to judge
        if node_id and len(events):  # a batch is one rank's: its first event names the rank
            first = events[0]
            self._nodes[(first.replica_group_id, first.gpu_id)] = node_id
        timed_out = []
        alerts = []
        with self.lock:
            self.dropped_total += dropped
            store = self.store
            before = store.accepted
            store.add_many(events, timed_out)
            accepted = store.accepted - before
            if timed_out or self.rules.links_pending:
                for e in events:
                    if e.timed_out:
                        alert = self._judge_timeout(e)
                        if alert is not None:
                            alerts.append(alert)
                    else:
                        self.rules.on_completed(e)
        for alert in alerts:
            self._publish(alert)
        return accepted

    def _judge_timeout(self, event: EventLike) -> Alert | None:
        members = self.store.series_of(event.replica_group_id)
        silent = [gpu for gpu in sorted(_not_heard_from(event, members)) if gpu != event.gpu_id]
        # the group's ranks: those heard from, and a communicator member never heard from at all (a
        # rank stopped before its first report is still the group's, and unhealthy with it)
        gpus = {s.gpu_id for s in members} | set(silent)
        alert = self.rules.on_timeout(event, group_gpu_ids=gpus, silent_gpu_ids=silent)
        nodes = self._silent_nodes(event.replica_group_id, set(silent))
        if alert is not None and nodes:  # a host that was lost or hung: all of its ranks went quiet
            alert = dataclasses.replace(alert, message=f"{alert.message} [on node {', '.join(nodes)}]")
        return alert

    def _silent_nodes(self, group: str, silent: set[str]) -> list[str]:
        """The nodes every one of whose ranks is silent. A rank that waits in the same collective on
        a healthy node goes quiet too (a broadcast relays through it), but its node's other ranks
        still report: the rank that timed out, at least."""
        by_node: dict[str, list[str]] = {}
        for (g, gpu), node in self._nodes.items():
            if g == group:
                by_node.setdefault(node, []).append(gpu)
        return sorted(node for node, gpus in by_node.items() if all(gpu in silent for gpu in gpus))

    # -- windows closing -------------------------------------------------------------------
    def tick(self, now_ms: int | None = None) -> list[Alert]:
        """Judge every window that ended at least ``close_grace_s`` ago; returns new alerts."""
        now = self._clock_ms() if now_ms is None else now_ms
        ops = self.config.rules.slow_ops
        alerts: list[Alert] = []
        with self.lock:
            store = self.store
            closable = store.window_index(now - round(self.config.close_grace_s * 1e3)) - 1
            for group in store.groups():
                last = self._judged.get(group)
                if last is None:
                    last = self._first_index(store.series_of(group)) - 1
                for index in range(last + 1, closable + 1):
                    durations = self._durations(store, group, ops, index)
                    if not durations:
                        continue
                    alert = self.rules.on_window_closed(group, store.bounds(index)[1], durations)
                    if alert is not None:
                        alerts.append(alert)
                self._judged[group] = max(last, closable)
            alerts += self.rules.on_tick(now)
            for group in store.forget_idle(now, self.config.forget_after_windows):
                self._judged.pop(group, None)
        for alert in alerts:
            self._publish(alert)
        return alerts

    @staticmethod
    def _durations(store: WindowStore, group: str, ops: tuple[str, ...], index: int) -> dict[str, LogHistogram]:
        """Each rank's durations of ``ops`` in window ``index``, one histogram per rank (merged into
        a copy where it ran more than one of them)."""
        out: dict[str, LogHistogram] = {}
        for op in ops:
            for gpu, w in store.stats_at(group, op, index).items():
                if gpu not in out:
                    out[gpu] = w.durations
                    continue
                merged = LogHistogram(w.durations.alpha)
                merged.merge(out[gpu])
                merged.merge(w.durations)
                out[gpu] = merged
        return out

    def _first_index(self, members: list[Series]) -> int:
        indices = [i for s in members for i in s.windows]
        return min(indices) if indices else 0

    # -- alerts ----------------------------------------------------------------------------
    def _publish(self, alert: Alert) -> None:
        node = self._nodes.get((alert.replica_group_id, alert.gpu_id))
        if node and alert.kind is AlertKind.SLOW_RANK:  # the straggler's node
            alert = dataclasses.replace(alert, message=f"{alert.message} [{alert.gpu_id} runs on node {node}]")
        log.warning("alert %s: %s", alert.kind.value, alert.message)
        with self.lock:
            self.alerts_fired += 1
            self.alerts_by_kind[alert.kind.value] = self.alerts_by_kind.get(alert.kind.value, 0) + 1
            self._history.append(alert)
            subscribers = [s for s in self._subscribers if s.wants(alert)]
        for sub in subscribers:
            sub.put(alert)
        if self._effects is not None:
            self._effects.submit(alert)

    def raise_alert(self, alert: Alert) -> None:
        """An alert raised outside the rules (a quality check, the fleet controller): published like
        the rules' own."""
        if alert.kind not in RAISED_KINDS:
            raise ValueError(f"{alert.kind.value} is decided by telemetry's rules, not raised from outside")
        if not alert.replica_group_id:
            raise ValueError("an alert names its replica group")
        self._publish(alert)

    def subscribe(self, replica_group_id: str = "", *, replay: bool = True) -> AlertSubscription:
        """A subscription to alerts (of one group, or all); ``replay`` first delivers the
        retained recent alerts, so a subscriber that connects late still sees what fired."""
        sub = AlertSubscription(replica_group_id, self._unsubscribe)
        with self.lock:
            past = [a for a in self._history if sub.wants(a)] if replay else []
            self._subscribers.append(sub)
        for alert in past:
            sub.put(alert)
        return sub

    def _unsubscribe(self, sub: AlertSubscription) -> None:
        with self.lock:
            if sub in self._subscribers:
                self._subscribers.remove(sub)

    def alerts(self) -> list[Alert]:
        with self.lock:
            return list(self._history)

    # -- reads -----------------------------------------------------------------------------
    def query(self, *, replica_group_id: str = "", gpu_id: str = "", op_type: str = "") -> list[WindowSummary]:
        with self.lock:
            return self.store.summaries(replica_group_id=replica_group_id, gpu_id=gpu_id, op_type=op_type,
                                        now_ms=self._clock_ms())

    def totals(self) -> list[tuple[str, str, str, int, SeriesTotals]]:
        """``(group, gpu, op, group_size, totals copy)`` of every series (for the exporters)."""
        with self.lock:
            return [(s.replica_group_id, s.gpu_id, s.op_type, s.group_size, s.totals.copy())
                    for s in self.store.series.values()]


def _not_heard_from(event: EventLike, members: list[Series]) -> set[str]:
    """The ranks of a group that reported nothing of the timed-out ``event`` since it was issued.
    A peer on its communicator is judged by count: it never finished the op if its highest number
    there is below the op's, whatever its clock said (a rank descheduled as it leaves a collective
    stamps its end late), and a peer of it that telemetry never heard from at all (stopped before
    its first events were shipped) is silent too. Any other rank is judged by the time its last
    event ended."""
    finished: dict[str, int] = {}
    last_seen: dict[str, int] = {}
    for s in members:
        last_seen[s.gpu_id] = max(last_seen.get(s.gpu_id, 0), s.last_seen_ms)
        if event.seq and s.communicator == event.communicator:
            finished[s.gpu_id] = max(finished.get(s.gpu_id, 0), s.last_seq)
    if event.seq:
        for gpu in communicator_members(event.replica_group_id, event.communicator, event.group_size):
            finished.setdefault(gpu, 0)
    began_ms = event.timestamp_ms - event.duration_ms + min(SAME_ROUND_MS, event.duration_ms / 4)
    return ({gpu for gpu, n in finished.items() if n < event.seq}
            | {gpu for gpu, seen in last_seen.items() if gpu not in finished and seen < began_ms})
