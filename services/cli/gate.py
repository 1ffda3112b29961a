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

Exit codes: 0 passed, 1 failed (or a replica group failed), 2 bad input.

    shardline gate --model .models/smollm2-135m-instruct --reference dtype=float32 \\
        --candidate tp=3,dtype=bfloat16
"""

from __future__ import annotations

import argparse
import json

from services.cli.compare import add_golden_arguments, figure_lines, figures_json, score_both
from services.cli.score import exit_code_for
from services.common.errors import InvalidArgument
from services.common.registry import QualityGateResult, ShardRegistry
from services.worker.plan_scoring import DEFAULT_THRESHOLD_PCT, GateResult, run_gate


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("gate", help="pass or fail a candidate plan against a reference on the golden set")
    add_golden_arguments(parser)
    parser.add_argument("--threshold-pct", type=float, default=DEFAULT_THRESHOLD_PCT,
                        help=f"largest perplexity delta accepted, in %% (default {DEFAULT_THRESHOLD_PCT:g})")
    parser.add_argument("--min-top1", type=float, default=None,
                        help="smallest greedy top-1 agreement accepted (default 0.97 for plans of one dtype "
                             "family, none across families)")
    parser.add_argument("--bootstrap-samples", type=int, default=1000,
                        help="resamples for the delta's 95%% interval (default 1000)")
    parser.add_argument("--no-record", action="store_true", help="do not record the verdict")
    parser.set_defaults(func=run)


def record(result: GateResult, registry_url: str | None) -> QualityGateResult:
    c, v = result.comparison, result.verdict
    with ShardRegistry(registry_url, migrate_schema=True) as registry:
        return registry.record_gate_result(
            model_name=result.reference.model_name, reference=result.reference.plan,
            candidate=result.candidate.plan, candidate_dtype=result.candidate.dtype,
            text_fingerprint=result.golden.text_fingerprint, chunks=c.chunks, scored_tokens=c.scored_tokens,
            reference_perplexity=c.reference_perplexity, candidate_perplexity=c.candidate_perplexity,
            perplexity_delta_pct=c.perplexity_delta_pct, delta_low_pct=v.delta_interval_pct[0],
            delta_high_pct=v.delta_interval_pct[1], mean_abs_logprob_delta=c.mean_abs_logprob_delta,
            p99_abs_logprob_delta=c.p99_abs_logprob_delta, top1_agreement=c.top1_agreement,
            threshold_pct=v.threshold_pct, min_top1_agreement=v.min_top1_agreement, passed=v.passed,
            reasons="\n".join(v.reasons))


def verdict_lines(result: GateResult, recorded: QualityGateResult | None) -> list[str]:
    v = result.verdict
    floor = "none" if v.min_top1_agreement is None else f"{v.min_top1_agreement:g}"
    lines = [f"perplexity delta 95 % interval {v.delta_interval_pct[0]:+.3f} .. {v.delta_interval_pct[1]:+.3f} % "
             f"(threshold {v.threshold_pct:g} %, top-1 floor {floor})",
             "verdict: PASS" if v.passed else "verdict: FAIL", *(f"  - {reason}" for reason in v.reasons)]
    if recorded is not None:
        lines.append(f"recorded as gate result {recorded.gate_id}")
    return lines


def run(args: argparse.Namespace) -> int:
    with exit_code_for("gate") as failed:
        if args.threshold_pct < 0 or args.bootstrap_samples < 1:
            raise InvalidArgument("--threshold-pct must be >= 0 and --bootstrap-samples >= 1")
        reference, candidate, golden = score_both(args)
        result = run_gate(reference, candidate, golden, threshold_pct=args.threshold_pct,
                          min_top1_agreement=args.min_top1, bootstrap_samples=args.bootstrap_samples)
        recorded = None if args.no_record else record(result, args.registry_url)
    if failed:
        return failed.code
    if args.json:
        v = result.verdict
        print(json.dumps({**figures_json(result.comparison, reference, candidate, golden), "passed": v.passed,
                          "reasons": list(v.reasons), "delta_interval_pct": list(v.delta_interval_pct),
                          "threshold_pct": v.threshold_pct, "min_top1_agreement": v.min_top1_agreement,
                          "gate_id": str(recorded.gate_id) if recorded else None}))
    else:
        print("\n".join([*figure_lines(result.comparison, reference, candidate, golden),
                         *verdict_lines(result, recorded)]))
    return 0 if result.verdict.passed else 1
