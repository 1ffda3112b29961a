"""Shipping a rank's CollectiveEvents to the telemetry service without slowing the rank down.

:class:`TelemetryShipper` is the coordinator's :class:`~services.common.collective_events.EventSink`
on a rank that has a telemetry address. ``record`` (on the forward pass) only samples and
appends to a bounded buffer, never waits and never does I/O; a background thread takes batches
(``batch_events`` events, or whatever came in ``flush_interval_s``) and writes them to a
client-streaming ``TelemetryService.Report`` call. A stream is closed and reopened every
``stream_max_s``, which is when the service confirms what it accepted.

Counters (plain ints, read by the metrics callbacks and the tests):

- ``dropped``: events lost: the buffer was full (telemetry slow), or telemetry was down: a failed
  attempt to reach it lets go of everything buffered, and of what it had handed to the stream
  (which may or may not have arrived). Attempts repeat with a backoff of up to ``backoff_max_s``,
  so while telemetry is down the counter rises at least that often.
- ``sampled_out``: events left out on purpose by the per-op sampling rate. A timed-out event is
  never sampled out, and when the buffer is full it pushes out the oldest event instead of
  being dropped.
- ``sent`` / ``accepted``: handed to a stream / confirmed by the service.

Start-up order loses nothing: a rank often starts beside its telemetry service (``shardline up``
starts both at once), so until the shipper has reached telemetry once, and for at most
``connect_wait_s`` from its creation, its first stream waits for the service to come up
(``wait_for_ready``) and the buffer keeps what the rank records meanwhile (a full one drops as
the counters say). Past that, or once telemetry has been reached, an attempt fails at once.
"""

from __future__ import annotations

import collections
import logging
import math
import os
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

import grpc

from services.common.collective_events import CollectiveEvent
from services.common.proto import telemetry_pb2, telemetry_pb2_grpc
from services.common.transport_security import TransportSecurity, open_channel
from services.telemetry.convert import alert_to_pb, event_to_pb
from services.telemetry.rules import Alert

log = logging.getLogger(__name__)

SAMPLE_ENV = "SHARDLINE_TELEMETRY_SAMPLE"
ADDRESS_ENV = "SHARDLINE_TELEMETRY_ADDR"
BUFFER_ENV = "SHARDLINE_TELEMETRY_BUFFER"  # events a rank buffers while telemetry is slow or down


class BadSampleSpec(ValueError):
    """A per-op sampling spec that is not ``op=rate,...`` with 0 <= rate <= 1."""


def parse_sample_rates(spec: str | None) -> dict[str, float]:
    """``"broadcast=0.1,all_reduce=1"`` -> ``{"broadcast": 0.1, "all_reduce": 1.0}``."""
    rates: dict[str, float] = {}
    for part in (spec or "").split(","):
        part = part.strip()
        if not part:
            continue
        op, sep, raw = part.partition("=")
        try:
            rate = float(raw)
        except ValueError:
            rate = math.nan
        if not sep or not op or not 0.0 <= rate <= 1.0:
            raise BadSampleSpec(f"bad sampling entry {part!r}: expected op=rate with 0 <= rate <= 1")
        rates[op.strip()] = rate
    return rates


@dataclass(frozen=True)
class ShipperConfig:
    """Picklable: it travels to spawned follower ranks."""

    address: str
    buffer_events: int = 65_536
    batch_events: int = 1_000
    flush_interval_s: float = 0.2
    stream_max_s: float = 2.0
    backoff_max_s: float = 2.0
    connect_wait_s: float = 10.0  # how long a new shipper's first stream waits for telemetry to come up
    sample_rates: Mapping[str, float] = field(default_factory=dict)
    security: TransportSecurity = field(default_factory=TransportSecurity)  # TLS and the internal token

    def __post_init__(self) -> None:
        if not self.address:
            raise ValueError("telemetry address must be host:port, got ''")
        if self.buffer_events < self.batch_events or self.batch_events < 1:
            raise ValueError(f"need 1 <= batch_events <= buffer_events, got {self.batch_events}, "
                             f"{self.buffer_events}")
        for op, rate in self.sample_rates.items():
            if not 0.0 <= rate <= 1.0:
                raise BadSampleSpec(f"sampling rate of {op} must be in [0, 1], got {rate}")

    @classmethod
    def from_settings(cls, address: str | None, sample: str | None = None, *,
                      security: TransportSecurity | None = None) -> ShipperConfig | None:
        """From flags, falling back to ``SHARDLINE_TELEMETRY_ADDR`` / ``SHARDLINE_TELEMETRY_SAMPLE``
        (and ``SHARDLINE_TELEMETRY_BUFFER``); None when no address is configured (telemetry off)."""
        address = address or os.environ.get(ADDRESS_ENV) or None
        if not address:
            return None
        buffer_events = int(os.environ.get(BUFFER_ENV) or cls.buffer_events)
        return cls(address, buffer_events=buffer_events, batch_events=min(cls.batch_events, buffer_events),
                   sample_rates=parse_sample_rates(sample if sample is not None else os.environ.get(SAMPLE_ENV)),
                   security=security or TransportSecurity())


class _Stream:
    __slots__ = ("failed", "sent")

    def __init__(self) -> None:
        self.failed = False
        self.sent = 0


class TelemetryShipper:
    """EventSink that batches events to ``TelemetryService.Report`` from a background thread."""

    def __init__(self, config: ShipperConfig, *, node_id: str = "") -> None:
        self.config = config
        self.node_id = node_id  # the node this rank runs on, sent with every batch
        self._buffer: collections.deque[CollectiveEvent] = collections.deque()
        self._capacity = config.buffer_events
        self._batch = config.batch_events
        self._rates = dict(config.sample_rates)
        self._seen: dict[str, int] = dict.fromkeys(self._rates, 0)
        self._ready = threading.Event()
        self._closing = threading.Event()
        self.dropped = 0
        self.sampled_out = 0
        self.sent = 0
        self.accepted = 0
        self.stream_failures = 0
        self._dropped_reported = 0
        self._reached = False  # a stream has ended confirmed by the service
        self._wait_until = time.monotonic() + config.connect_wait_s
        self._channel = open_channel(config.address, config.security)
        self._stub = telemetry_pb2_grpc.TelemetryServiceStub(self._channel)
        self._thread = threading.Thread(target=self._run, name="telemetry-shipper", daemon=True)
        self._thread.start()

    # -- the forward pass's side: never blocks ----------------------------------------------
    def record(self, event: CollectiveEvent) -> None:
        rate = self._rates.get(event.op_type)
        if rate is not None and not event.timed_out:
            # keep the n-th event of the op when floor(n * rate) steps up: exactly rate, evenly spread
            n = self._seen[event.op_type] = self._seen[event.op_type] + 1
            if int(n * rate + 1e-9) == int((n - 1) * rate + 1e-9):
                self.sampled_out += 1
                return
        buf = self._buffer
        if len(buf) >= self._capacity:
            if not event.timed_out:
                self.dropped += 1
                return
            try:
                buf.popleft()
                self.dropped += 1
            except IndexError:
                pass
        buf.append(event)
        if len(buf) >= self._batch:
            self._ready.set()

    @property
    def buffered(self) -> int:
        return len(self._buffer)

    def stats(self) -> dict[str, int]:
        return {"sent": self.sent, "accepted": self.accepted, "dropped": self.dropped,
                "sampled_out": self.sampled_out, "buffered": len(self._buffer),
                "stream_failures": self.stream_failures}

    # -- background ------------------------------------------------------------------------
    def _take(self) -> list[CollectiveEvent]:
        buf, out = self._buffer, []
        for _ in range(min(self._batch, len(buf))):
            out.append(buf.popleft())
        return out

    def _requests(self, stream: _Stream) -> Iterator[telemetry_pb2.ReportRequest]:
        started = time.monotonic()
        cfg = self.config
        while True:
            deadline = time.monotonic() + cfg.flush_interval_s
            while len(self._buffer) < self._batch and not self._closing.is_set():
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                self._ready.wait(remaining)
                self._ready.clear()
            batch = self._take()
            if stream.failed:
                self._buffer.extendleft(reversed(batch))
                return
            dropped = self.dropped
            if batch or dropped != self._dropped_reported:
                stream.sent += len(batch)
                self.sent += len(batch)
                yield telemetry_pb2.ReportRequest(events=[event_to_pb(e) for e in batch],
                                                  dropped=dropped - self._dropped_reported, node_id=self.node_id)
                self._dropped_reported = dropped
            if self._closing.is_set() and not self._buffer:
                return
            if time.monotonic() - started >= cfg.stream_max_s:
                return

    def _run(self) -> None:
        backoff = 0.0
        cfg = self.config
        while True:
            if self._closing.is_set() and not self._buffer:
                return
            stream = _Stream()
            # a rank started beside its telemetry: its first stream waits for it rather than fail at once
            wait_s = 0.0 if self._reached else max(0.0, self._wait_until - time.monotonic())
            try:
                response = self._stub.Report(self._requests(stream), timeout=cfg.stream_max_s + 10.0 + wait_s,
                                             wait_for_ready=wait_s > 0)
                self.accepted += response.accepted
                self._reached = True
                backoff = 0.0
            except grpc.RpcError as exc:
                stream.failed = True
                self.stream_failures += 1
                # telemetry is down: what was handed over was never confirmed, and what waits in the
                # buffer is let go rather than kept for an unknown time
                self.dropped += stream.sent + self._discard_buffer()
                if self.stream_failures == 1 or self.stream_failures % 100 == 0:
                    log.warning("telemetry at %s unavailable (%s); events are dropped until it is back "
                                "(%d so far)", cfg.address, exc.code() if hasattr(exc, "code") else exc,
                                self.dropped)
                if self._closing.is_set():
                    return
                backoff = min(cfg.backoff_max_s, max(cfg.flush_interval_s, backoff * 2))
                self._closing.wait(backoff)

    def _discard_buffer(self) -> int:
        n = 0
        try:
            while True:
                self._buffer.popleft()
                n += 1
        except IndexError:
            return n

    def close(self, timeout_s: float = 2.0) -> None:
        """Flush what is buffered (up to ``timeout_s``) and stop the thread."""
        self._closing.set()
        self._ready.set()
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            self.dropped += len(self._buffer)
        self._channel.close()


def raise_alert(address: str, alert: Alert, *, timeout_s: float = 5.0,
                security: TransportSecurity | None = None) -> None:
    """Hands a quality alert (shadow divergence, drift) to telemetry, which publishes it to the
    Alerts subscribers and applies it to the group's status. Raises grpc.RpcError."""
    with open_channel(address, security) as channel:
        telemetry_pb2_grpc.TelemetryServiceStub(channel).RaiseAlert(
            telemetry_pb2.RaiseAlertRequest(alert=alert_to_pb(alert)), timeout=timeout_s)

