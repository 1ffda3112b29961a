"""`shardline compare`: score two shard plans of one model on the golden set and say how far apart they are.

A plan is written ``key=value`` pairs joined by commas, from ``tp``, ``pp``, ``dtype``,
``checkpoint`` (a manifest.json) and ``model`` (another model directory with the same tokenizer,
e.g. a fine-tune or a perturbed copy), e.g. ``--reference dtype=float32 --candidate
tp=2,dtype=bfloat16``. The golden set is tokenized with ``--model``'s tokenizer. Each plan runs as a local replica
group that scores every chunk; the figures are those of
:mod:`services.common.logprob_comparison`.

    shardline compare --model .models/smollm2-135m-instruct --reference dtype=float32 \\
        --candidate dtype=bfloat16
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass

from services.cli.score import exit_code_for
from services.common.errors import InvalidArgument
from services.common.logprob_comparison import Comparison, compare
from services.modeling.golden_set import DEFAULT_CHUNK_TOKENS, DEFAULT_CHUNKS, GoldenSet
from services.worker.engine.bootstrap import load_tokenizer
from services.worker.launch import run_replica_group
from services.worker.runtime import RankSpec, stage_tokenizer_dir
from services.worker.scoring import ScoreResult, score_chunks_rank

PLAN_KEYS = ("tp", "pp", "dtype", "checkpoint", "model")


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("compare", help="score two shard plans on the golden set and compare them")
    parser.add_argument("--model", default=None, help="Hugging Face model directory (weights and tokenizer)")
    parser.add_argument("--reference", required=True, metavar="PLAN",
                        help="the trusted plan, e.g. 'dtype=float32' or 'tp=1,pp=1,dtype=bfloat16'")
    parser.add_argument("--candidate", required=True, metavar="PLAN",
                        help="the plan to judge, e.g. 'tp=2,dtype=int8' or 'checkpoint=out/manifest.json'")
    parser.add_argument("--chunks", type=int, default=DEFAULT_CHUNKS,
                        help=f"golden-set chunks to score (default {DEFAULT_CHUNKS})")
    parser.add_argument("--chunk-tokens", type=int, default=DEFAULT_CHUNK_TOKENS,
                        help=f"tokens per chunk (default {DEFAULT_CHUNK_TOKENS})")
    parser.add_argument("--collective-timeout", type=float, default=30.0,
                        help="seconds before a hung collective fails a group (default 30: a chunk's prefill "
                             "on a busy CPU is slow)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.set_defaults(func=run)


def parse_plan(text: str) -> dict[str, str]:
    """``"tp=2,dtype=int8"`` -> ``{"tp": "2", "dtype": "int8"}``; unknown keys are an error."""
    plan: dict[str, str] = {}
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or key not in PLAN_KEYS or not value.strip():
            raise InvalidArgument(f"plan {text!r}: expected key=value pairs with keys {', '.join(PLAN_KEYS)}, "
                                  f"got {item!r}")
        plan[key] = value.strip()
    return plan


def plan_spec(model_dir: str | None, text: str, collective_timeout_s: float) -> RankSpec:
    plan = parse_plan(text)
    try:
        tp, pp = int(plan.get("tp", 1)), int(plan.get("pp", 1))
    except ValueError:
        raise InvalidArgument(f"plan {text!r}: tp and pp are whole numbers") from None
    checkpoint = plan.get("checkpoint")
    return RankSpec(None if checkpoint else plan.get("model", model_dir), tp_degree=tp, pp_degree=pp, dtype=plan.get("dtype"),
                    checkpoint=checkpoint, collective_timeout_s=collective_timeout_s,
                    replica_group_id=f"compare-{text}")


@dataclass(frozen=True)
class PlanScores:
    plan: str
    results: list[ScoreResult]
    seconds: float


def score_plan(spec: RankSpec, text: str, golden: GoldenSet, collective_timeout_s: float) -> PlanScores:
    start = time.perf_counter()
    results = run_replica_group(spec.plan.world_size, score_chunks_rank, spec, [list(c) for c in golden.chunks],
                                failure_grace_s=collective_timeout_s + 3.0)
    return PlanScores(text, results, time.perf_counter() - start)


def render(comparison: Comparison, reference: PlanScores, candidate: PlanScores, golden: GoldenSet) -> str:
    c = comparison
    return "\n".join([
        f"golden set: {c.chunks} chunks x {golden.chunk_tokens} tokens = {c.scored_tokens} scored positions "
        f"(text {golden.text_fingerprint})",
        f"{'plan':<12} {'spec':<36} {'perplexity':>10} {'seconds':>8}",
        f"{'reference':<12} {reference.plan:<36} {c.reference_perplexity:>10.4f} {reference.seconds:>8.1f}",
        f"{'candidate':<12} {candidate.plan:<36} {c.candidate_perplexity:>10.4f} {candidate.seconds:>8.1f}",
        f"perplexity delta {c.perplexity_delta_pct:+.3f} %",
        f"|d logprob| mean {c.mean_abs_logprob_delta:.5f}  p99 {c.p99_abs_logprob_delta:.5f}  "
        f"max {c.max_abs_logprob_delta:.5f}",
        f"top-1 agreement {c.top1_agreement:.4f}",
    ])


def run(args: argparse.Namespace) -> int:
    with exit_code_for("compare") as failed:
        reference_spec = plan_spec(args.model, args.reference, args.collective_timeout)
        candidate_spec = plan_spec(args.model, args.candidate, args.collective_timeout)
        tokenizer = load_tokenizer(args.model or stage_tokenizer_dir(reference_spec))
        if tokenizer is None:
            raise InvalidArgument("the golden set needs the model's tokenizer.json (give --model DIR)")
        try:
            golden = GoldenSet.build(lambda text: tokenizer.encode(text, add_special_tokens=False).ids,
                                     chunks=args.chunks, chunk_tokens=args.chunk_tokens)
        except ValueError as exc:
            raise InvalidArgument(str(exc)) from None
        vocab = reference_spec.plan.config.vocab_size
        for spec in (reference_spec, candidate_spec):
            if spec.plan.config.vocab_size != vocab:
                raise InvalidArgument(f"the plans' vocabularies differ ({vocab} and {spec.plan.config.vocab_size}): "
                                      f"they cannot be scored on the same tokens")
            if golden.chunk_tokens > spec.plan.config.max_position_embeddings:
                raise InvalidArgument(f"--chunk-tokens {golden.chunk_tokens} exceeds the model's "
                                      f"max_position_embeddings {spec.plan.config.max_position_embeddings}")
        reference = score_plan(reference_spec, args.reference, golden, args.collective_timeout)
        candidate = score_plan(candidate_spec, args.candidate, golden, args.collective_timeout)
        comparison = compare(reference.results, candidate.results)
    if failed:
        return failed.code
    if args.json:
        print(json.dumps({**comparison.to_dict(), "reference": args.reference, "candidate": args.candidate,
                          "text_fingerprint": golden.text_fingerprint, "chunk_tokens": golden.chunk_tokens,
                          "reference_seconds": reference.seconds, "candidate_seconds": candidate.seconds}))
    else:
        print(render(comparison, reference, candidate, golden))
    return 0
