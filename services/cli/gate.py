"""`shardline gate`: pass or fail a candidate shard plan against a reference on the golden set.

Both plans are scored as in ``shardline compare``. The candidate passes only if the perplexity
delta is within ``--threshold-pct`` with confidence (the upper end of its 95 % bootstrap interval
over chunks) and, for plans of one dtype family (float32; bfloat16 and float16; int8; fp8),
greedy top-1 agreement reaches ``--min-top1`` (default 0.97; across families, e.g. int8 or
bfloat16 against float32, only if given). The verdict and its
figures are printed and recorded in the registry's ``quality_gate_results``.

Either side may be a serving replica group, ``worker=HOST:PORT`` or ``group=ID``: the golden set goes through its
worker's Score between its engine steps (tokenized with ``--model``'s tokenizer), so a live
group's numbers can be checked against a trusted local plan, e.g. for drift.

``--group ID`` (instead of ``--candidate``) is the drift check of one serving replica group: its
worker against ``--reference`` (default ``dtype=float32``) of ``--model`` (required: the trusted
weights; workers do not report their model directory), recorded under ``group=<name>``;
``--group ID --history`` lists the group's recorded verdicts, oldest first, so its perplexity
over time is visible (``shardline drift`` records one per period).

Exit codes: 0 passed, 1 failed (or a replica group failed), 2 bad input.

    shardline gate --model .models/smollm2-135m-instruct --reference dtype=float32 \\
        --candidate tp=3,dtype=bfloat16
    shardline gate --model .models/smollm2-135m-instruct --group rg-0-3fa2c1 --chunks 8
    shardline gate --group rg-0-3fa2c1 --history
"""

from __future__ import annotations

import argparse
import json

from services.cli.compare import add_golden_arguments, figure_lines, figures_json, score_both
from services.cli.score import exit_code_for
from services.common.errors import InvalidArgument
from services.common.registry import QualityGateResult
from services.quality.drift import DEFAULT_REFERENCE, DriftChecker, drift_history, group_label
from services.quality.gate import DEFAULT_THRESHOLD_PCT, GateResult, record_gate, run_gate


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("gate", help="pass or fail a candidate plan against a reference on the golden set")
    add_golden_arguments(parser, sides_required=False)
    parser.add_argument("--group", default=None, metavar="ID",
                        help="drift check of a serving replica group (registry name or UUID) instead of "
                             f"--candidate: its worker against --reference (default {DEFAULT_REFERENCE}) of "
                             "--model (required)")
    parser.add_argument("--history", action="store_true",
                        help="with --group: list the group's recorded drift verdicts, oldest first, instead of "
                             "checking it")
    parser.add_argument("--last", type=int, default=20, help="with --history: how many verdicts (default 20)")
    parser.add_argument("--threshold-pct", type=float, default=DEFAULT_THRESHOLD_PCT,
                        help=f"largest perplexity delta accepted, in %% (default {DEFAULT_THRESHOLD_PCT:g})")
    parser.add_argument("--min-top1", type=float, default=None,
                        help="smallest greedy top-1 agreement accepted (default 0.97 for plans of one dtype "
                             "family, none across families)")
    parser.add_argument("--bootstrap-samples", type=int, default=1000,
                        help="resamples for the delta's 95%% interval (default 1000)")
    parser.add_argument("--no-record", action="store_true", help="do not record the verdict")
    parser.set_defaults(func=run)


def verdict_lines(result: GateResult, recorded: QualityGateResult | None) -> list[str]:
    v = result.verdict
    floor = "none" if v.min_top1_agreement is None else f"{v.min_top1_agreement:g}"
    judged = ("every logprob equal (two layout-invariant plans of the same weights)" if v.exact else
              f"perplexity delta 95 % interval {v.delta_interval_pct[0]:+.3f} .. {v.delta_interval_pct[1]:+.3f} % "
              f"(threshold {v.threshold_pct:g} %, top-1 floor {floor})")
    lines = [judged, "verdict: PASS" if v.passed else "verdict: FAIL", *(f"  - {reason}" for reason in v.reasons)]
    if recorded is not None:
        lines.append(f"recorded as gate result {recorded.gate_id}")
    return lines


def gate_args(args: argparse.Namespace) -> GateResult:
    """Score and gate what ``args`` name: ``--group`` against its reference, or the two plans."""
    if args.threshold_pct < 0 or args.bootstrap_samples < 1:
        raise InvalidArgument("--threshold-pct must be >= 0 and --bootstrap-samples >= 1")
    if args.group is not None:
        if args.candidate is not None:
            raise InvalidArgument("give --candidate PLAN or --group ID, not both")
        checker = DriftChecker(args.model, args.reference or DEFAULT_REFERENCE, registry_url=args.registry_url,
                               chunks=args.chunks, chunk_tokens=args.chunk_tokens, threshold_pct=args.threshold_pct,
                               min_top1_agreement=args.min_top1, bootstrap_samples=args.bootstrap_samples,
                               collective_timeout_s=args.collective_timeout)
        return checker.check(group_label(args.group, args.registry_url))
    if args.reference is None or args.candidate is None:
        raise InvalidArgument("give --reference PLAN and --candidate PLAN (or --group ID for a serving group)")
    reference, candidate, golden = score_both(args)
    return run_gate(reference, candidate, golden, threshold_pct=args.threshold_pct,
                    min_top1_agreement=args.min_top1, bootstrap_samples=args.bootstrap_samples)


def run(args: argparse.Namespace) -> int:
    if args.history:
        return show_history(args)
    with exit_code_for("gate") as failed:
        result = gate_args(args)
        recorded = None if args.no_record else record_gate(result, args.registry_url)
    if failed:
        return failed.code
    reference, candidate, golden = result.reference, result.candidate, result.golden
    if args.json:
        v = result.verdict
        print(json.dumps({**figures_json(result.comparison, reference, candidate, golden), "passed": v.passed,
                          "reasons": list(v.reasons), "delta_interval_pct": list(v.delta_interval_pct),
                          "threshold_pct": v.threshold_pct, "min_top1_agreement": v.min_top1_agreement,
                          "exact": v.exact,
                          "gate_id": str(recorded.gate_id) if recorded else None}))
    else:
        print("\n".join([*figure_lines(result.comparison, reference, candidate, golden),
                         *verdict_lines(result, recorded)]))
    return 0 if result.verdict.passed else 1


def history_json(row: QualityGateResult) -> dict:
    return {"gate_id": str(row.gate_id), "created_at": row.created_at.isoformat(), "reference": row.reference,
            "candidate": row.candidate, "chunks": row.chunks, "scored_tokens": row.scored_tokens,
            "reference_perplexity": row.reference_perplexity, "candidate_perplexity": row.candidate_perplexity,
            "perplexity_delta_pct": row.perplexity_delta_pct, "delta_high_pct": row.delta_high_pct,
            "top1_agreement": row.top1_agreement, "threshold_pct": row.threshold_pct, "passed": row.passed}


def show_history(args: argparse.Namespace) -> int:
    """The group's recorded verdicts, oldest first (the last ``--last`` of them)."""
    with exit_code_for("gate") as failed:
        if args.group is None:
            raise InvalidArgument("--history needs --group ID")
        if args.last < 1:
            raise InvalidArgument(f"--last must be >= 1, got {args.last}")
        try:
            label = group_label(args.group, args.registry_url)
        except InvalidArgument:  # a group gone from the registry keeps its history
            label = args.group
        rows = drift_history(label, args.registry_url)[-args.last:]
    if failed:
        return failed.code
    if args.json:
        print(json.dumps({"group": label, "results": [history_json(row) for row in rows]}))
        return 0
    print(f"drift history of group {label}: {len(rows)} verdict(s), oldest first")
    print(f"{'time (UTC)':<20} {'reference':<16} {'chunks':>6} {'ref ppl':>10} {'group ppl':>10} {'delta %':>8} "
          f"{'95% high':>8} {'thr %':>6} {'top-1':>6}  verdict")
    for row in rows:
        print(f"{row.created_at:%Y-%m-%d %H:%M:%S}  {row.reference:<16} {row.chunks:>6} "
              f"{row.reference_perplexity:>10.4f} {row.candidate_perplexity:>10.4f} {row.perplexity_delta_pct:>+8.3f} "
              f"{row.delta_high_pct:>+8.3f} {row.threshold_pct:>6g} {row.top1_agreement:>6.3f}  "
              f"{'PASS' if row.passed else 'FAIL'}")
    return 0
