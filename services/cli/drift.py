"""`shardline drift`: the drift check of every serving replica group, on a schedule.

Every ``--every`` seconds each group the registry has in rotation (healthy or degraded, with an
endpoint), or only those named with ``--group``, is scored through its worker on the first
``--chunks`` chunks of the golden set and gated against ``--reference`` of ``--model`` (scored
once, when the monitor starts, and reused), as ``shardline gate --group`` does. Each verdict is
recorded in the registry under ``group=<name>`` (``shardline gate --group ID --history`` lists
them). A failing group gets an ``ALERT_KIND_QUALITY_DRIFT`` alert naming it, raised through
telemetry (which tells the Alerts subscribers and marks the group degraded), again each period
it still fails; a group that passes again is logged as cleared. A group that does not answer,
a registry or telemetry that is down, is logged and the monitor goes on.

    shardline drift --every 600 --model .models/smollm2-135m-instruct \\
        --registry-url postgresql+psycopg://... --telemetry 127.0.0.1:50055
"""

from __future__ import annotations

import argparse
import logging
import sys
import threading
import time

import grpc

from services.common.errors import ShardlineError
from services.common.group_status import GroupStatus
from services.common.logging import configure_logging
from services.common.stop_signals import SignalListener
from services.quality.drift import DEFAULT_DRIFT_CHUNKS, DEFAULT_REFERENCE, DriftChecker, serving_groups
from services.quality.gate import DEFAULT_COLLECTIVE_TIMEOUT_S, DEFAULT_THRESHOLD_PCT, GateResult, record_gate
from services.quality.golden_set import DEFAULT_CHUNK_TOKENS
from services.telemetry.client import raise_alert
from services.telemetry.rules import Alert, AlertKind

log = logging.getLogger("shardline.drift")


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("drift", help="check every serving group's golden-set numbers on a schedule")
    parser.add_argument("--every", type=float, required=True, metavar="SECONDS",
                        help="seconds from the start of one round of checks to the next")
    parser.add_argument("--model", required=True,
                        help="the trusted model directory the reference plan runs on (and its tokenizer)")
    parser.add_argument("--reference", default=DEFAULT_REFERENCE, metavar="PLAN",
                        help=f"the reference plan (default {DEFAULT_REFERENCE})")
    parser.add_argument("--group", action="append", default=None, metavar="ID",
                        help="check only this group (repeatable; default every serving group in the registry)")
    parser.add_argument("--registry-url", default=None,
                        help="the registry (env SHARDLINE_REGISTRY_URL; default the embedded SQLite registry)")
    parser.add_argument("--telemetry", default=None, metavar="ADDR",
                        help="telemetry's gRPC address, where drift alerts go (none: verdicts are only "
                             "recorded and logged)")
    parser.add_argument("--chunks", type=int, default=DEFAULT_DRIFT_CHUNKS,
                        help=f"golden-set chunks per check (default {DEFAULT_DRIFT_CHUNKS})")
    parser.add_argument("--chunk-tokens", type=int, default=DEFAULT_CHUNK_TOKENS,
                        help=f"tokens per chunk (default {DEFAULT_CHUNK_TOKENS})")
    parser.add_argument("--threshold-pct", type=float, default=DEFAULT_THRESHOLD_PCT,
                        help=f"largest perplexity delta accepted, in %% (default {DEFAULT_THRESHOLD_PCT:g})")
    parser.add_argument("--min-top1", type=float, default=None,
                        help="smallest greedy top-1 agreement accepted (default as in shardline gate)")
    parser.add_argument("--collective-timeout", type=float, default=DEFAULT_COLLECTIVE_TIMEOUT_S,
                        help=f"the reference plan's collective timeout (default {DEFAULT_COLLECTIVE_TIMEOUT_S:g} s)")
    parser.add_argument("--rounds", type=int, default=0,
                        help="stop after this many rounds (default 0: until SIGTERM or Ctrl-C)")
    parser.add_argument("--no-record", action="store_true", help="do not record the verdicts")
    parser.set_defaults(func=run)


def drift_alert(result: GateResult, group: str) -> Alert:
    c, v = result.comparison, result.verdict
    message = (f"{group}: golden-set perplexity {c.candidate_perplexity:.4f} vs {c.reference_perplexity:.4f} of "
               f"{result.reference.plan} ({c.perplexity_delta_pct:+.3f} %, 95 % interval "
               f"{v.delta_interval_pct[0]:+.3f} .. {v.delta_interval_pct[1]:+.3f} %, threshold {v.threshold_pct:g} %), "
               f"top-1 agreement {c.top1_agreement:.4f}: " + "; ".join(v.reasons))
    return Alert(AlertKind.QUALITY_DRIFT, group, "", "", GroupStatus.DEGRADED, message, int(time.time() * 1000),
                 perplexity_delta_pct=c.perplexity_delta_pct, threshold_pct=v.threshold_pct,
                 reference=result.reference.plan)


class DriftMonitor:
    """One round of checks at a time; remembers which groups failed last, to log a clearance."""

    def __init__(self, checker: DriftChecker, *, telemetry: str | None, groups: list[str] | None,
                 record_results: bool) -> None:
        self.checker = checker
        self.telemetry = telemetry
        self.groups = groups
        self.record_results = record_results
        self.failing: set[str] = set()
        self.schema_ready = False  # the gate results table, checked by the first recording only

    def round(self) -> dict[str, bool | None]:
        """Check every group once: ``{group: passed}``, None where it could not be checked."""
        try:
            reference = self.checker.reference  # scored the first time only
            groups = self.groups if self.groups is not None else serving_groups(self.checker.registry_url)
        except Exception as exc:  # the registry or the reference plan: try again next round
            log.error("drift round skipped: %s: %s", type(exc).__name__, exc)
            return {}
        if not groups:
            log.info("no serving replica group to check")
        log.debug("reference %s perplexity scored in %.1f s", reference.plan, reference.seconds)
        return {group: self.check(group) for group in groups}

    def check(self, group: str) -> bool | None:
        try:
            result = self.checker.check(group)
        except Exception as exc:  # unreachable, gone from the registry, the registry down: next round
            log.warning("group %s not checked: %s: %s", group, type(exc).__name__, exc)
            return None
        c, v = result.comparison, result.verdict
        log.info("group %s: %s, perplexity %.4f vs %.4f (%+.3f %%, 95 %% high %+.3f %%, threshold %g %%), top-1 %.4f",
                 group, "PASS" if v.passed else "FAIL", c.candidate_perplexity, c.reference_perplexity,
                 c.perplexity_delta_pct, v.delta_interval_pct[1], v.threshold_pct, c.top1_agreement)
        if self.record_results:
            try:
                record_gate(result, self.checker.registry_url, migrate_schema=not self.schema_ready)
            except Exception as exc:  # the registry may be down; the verdict still alerts
                log.warning("group %s: verdict not recorded: %s: %s", group, type(exc).__name__, exc)
            else:
                self.schema_ready = True
        if v.passed:
            if group in self.failing:
                self.failing.discard(group)
                log.info("group %s passes again: drift cleared", group)
            return True
        self.failing.add(group)
        self.alert(result, group)
        return False

    def alert(self, result: GateResult, group: str) -> None:
        if self.telemetry is None:
            log.warning("group %s drifted (no --telemetry: no alert raised)", group)
            return
        try:
            raise_alert(self.telemetry, drift_alert(result, group))
            log.warning("group %s drifted: ALERT_KIND_QUALITY_DRIFT raised at %s", group, self.telemetry)
        except grpc.RpcError as exc:
            log.error("group %s drifted, but telemetry %s did not take the alert: %s: %s", group, self.telemetry,
                      exc.code().name, exc.details())


def run(args: argparse.Namespace) -> int:
    configure_logging()
    if not args.every > 0 or args.chunks < 1 or args.rounds < 0:
        print("shardline drift: --every must be > 0, --chunks >= 1 and --rounds >= 0", file=sys.stderr)
        return 2
    try:
        checker = DriftChecker(args.model, args.reference, registry_url=args.registry_url, chunks=args.chunks,
                               chunk_tokens=args.chunk_tokens, threshold_pct=args.threshold_pct,
                               min_top1_agreement=args.min_top1, collective_timeout_s=args.collective_timeout)
    except (ShardlineError, ValueError, FileNotFoundError) as exc:
        print(f"shardline drift: {exc}", file=sys.stderr)
        return 2
    monitor = DriftMonitor(checker, telemetry=args.telemetry, groups=args.group, record_results=not args.no_record)
    stop = threading.Event()
    log.info("drift check every %g s: %s against %s of %s, %d chunks x %d tokens", args.every,
             ", ".join(args.group) if args.group else "every serving group", args.reference, args.model,
             args.chunks, args.chunk_tokens)
    with SignalListener(lambda _signum: stop.set()):
        rounds = 0
        while not stop.is_set():
            started = time.monotonic()
            monitor.round()
            rounds += 1
            if args.rounds and rounds >= args.rounds:
                break
            stop.wait(max(0.0, args.every - (time.monotonic() - started)))
    return 0
