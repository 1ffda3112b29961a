"""`shardline compare`: score two shard plans of one model on the golden set and say how far apart they are.

Plans are written as :mod:`services.quality.gate` reads them (``dtype=float32``,
``tp=2,dtype=bfloat16``, ``checkpoint=out/manifest.json``, ``model=DIR``); the figures are those
of :mod:`services.quality.comparison`.

    shardline compare --model .models/smollm2-135m-instruct --reference dtype=float32 \\
        --candidate dtype=bfloat16
"""

from __future__ import annotations

import argparse
import json

from services.cli.score import exit_code_for
from services.quality.comparison import Comparison, compare
from services.quality.gate import (
    DEFAULT_COLLECTIVE_TIMEOUT_S,
    PlanScores,
    check_comparable,
    golden_set_for,
    is_live,
    plan_spec,
    score_live_group,
    score_plan,
)
from services.quality.golden_set import DEFAULT_CHUNK_TOKENS, DEFAULT_CHUNKS, GoldenSet


def add_golden_arguments(parser: argparse.ArgumentParser, *, sides_required: bool = True) -> None:
    """The flags ``compare`` and ``gate`` share: the model, the two plans, the golden set.
    ``sides_required`` False: the caller checks ``--reference`` and ``--candidate`` itself (``gate``,
    whose ``--group`` stands for the candidate)."""
    parser.add_argument("--model", default=None, help="Hugging Face model directory (weights and tokenizer)")
    parser.add_argument("--reference", required=sides_required, default=None, metavar="PLAN",
                        help="the trusted plan, e.g. 'dtype=float32' or 'tp=1,pp=1,dtype=bfloat16'")
    parser.add_argument("--candidate", required=sides_required, default=None, metavar="PLAN",
                        help="the plan to judge, e.g. 'tp=2,dtype=int8' or 'checkpoint=out/manifest.json', or a "
                             "serving replica group: 'worker=HOST:PORT' or 'group=ID'")
    parser.add_argument("--chunks", type=int, default=DEFAULT_CHUNKS,
                        help=f"golden-set chunks to score (default {DEFAULT_CHUNKS})")
    parser.add_argument("--chunk-tokens", type=int, default=DEFAULT_CHUNK_TOKENS,
                        help=f"tokens per chunk (default {DEFAULT_CHUNK_TOKENS})")
    parser.add_argument("--collective-timeout", type=float, default=DEFAULT_COLLECTIVE_TIMEOUT_S,
                        help=f"seconds before a hung collective fails a group (default "
                             f"{DEFAULT_COLLECTIVE_TIMEOUT_S:g}: a chunk's prefill on a busy CPU is slow)")
    parser.add_argument("--registry-url", default=None,
                        help="the registry where group=ID is looked up (and where gate records its verdict) "
                             "(env SHARDLINE_REGISTRY_URL; default the embedded SQLite registry)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("compare", help="score two shard plans on the golden set and compare them")
    add_golden_arguments(parser)
    parser.set_defaults(func=run)


def score_both(args: argparse.Namespace) -> tuple[PlanScores, PlanScores, GoldenSet]:
    """Both sides of ``args`` scored on the golden set: local plans (bad ones raise before anything
    runs) or live replica groups (``worker=HOST:PORT``, ``group=ID``), tokenized with ``--model``'s tokenizer."""
    sides = [(text, None if is_live(text) else plan_spec(args.model, text,
                                                       collective_timeout_s=args.collective_timeout))
             for text in (args.reference, args.candidate)]
    specs = [spec for _, spec in sides if spec is not None]
    golden = golden_set_for(args.model, specs[0] if specs else None, chunks=args.chunks,
                            chunk_tokens=args.chunk_tokens)
    check_comparable(specs, golden)
    reference, candidate = (score_live_group(text, golden, registry_url=args.registry_url) if spec is None
                            else score_plan(spec, text, golden) for text, spec in sides)
    return reference, candidate, golden


def figure_lines(c: Comparison, reference: PlanScores, candidate: PlanScores, golden: GoldenSet) -> list[str]:
    return [
        f"golden set: {c.chunks} chunks x {golden.chunk_tokens} tokens = {c.scored_tokens} scored positions "
        f"(text {golden.text_fingerprint})",
        f"{'plan':<12} {'spec':<36} {'perplexity':>10} {'seconds':>8}",
        f"{'reference':<12} {reference.plan:<36} {c.reference_perplexity:>10.4f} {reference.seconds:>8.1f}",
        f"{'candidate':<12} {candidate.plan:<36} {c.candidate_perplexity:>10.4f} {candidate.seconds:>8.1f}",
        f"perplexity delta {c.perplexity_delta_pct:+.3f} %",
        f"|d logprob| mean {c.mean_abs_logprob_delta:.5f}  p99 {c.p99_abs_logprob_delta:.5f}  "
        f"max {c.max_abs_logprob_delta:.5f}",
        f"top-1 agreement {c.top1_agreement:.4f}",
    ]


def figures_json(c: Comparison, reference: PlanScores, candidate: PlanScores, golden: GoldenSet) -> dict:
    return {**c.to_dict(), "reference": reference.plan, "candidate": candidate.plan,
            "text_fingerprint": golden.text_fingerprint, "chunk_tokens": golden.chunk_tokens,
            "reference_seconds": reference.seconds, "candidate_seconds": candidate.seconds}


def run(args: argparse.Namespace) -> int:
    with exit_code_for("compare") as failed:
        reference, candidate, golden = score_both(args)
        comparison = compare(reference.results, candidate.results)
    if failed:
        return failed.code
    if args.json:
        print(json.dumps(figures_json(comparison, reference, candidate, golden)))
    else:
        print("\n".join(figure_lines(comparison, reference, candidate, golden)))
    return 0
