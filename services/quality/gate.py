"""Shard plans scored on the golden set: what ``shardline compare`` and ``shardline gate`` run,
and what a fleet controller calls before a new plan takes traffic.

A plan is written ``key=value`` pairs joined by commas, from ``tp``, ``pp``, ``dtype``,
``checkpoint`` (a manifest.json), ``model`` (another model directory with the same tokenizer,
e.g. a fine-tune or a perturbed copy) and ``lm_head`` (``quantized``, the default but for a
compressed-tensors checkpoint that left it dense, or ``dense``: an int8/fp8 plan's lm_head):
``dtype=float32``, ``tp=2,dtype=bfloat16``, ``dtype=fp8,lm_head=dense``. Each plan runs as a local
replica group (its ranks spawned here) that scores every chunk as its own prompt;
``worker=HOST:PORT`` or ``group=ID`` (its endpoint in the registry) instead names a serving
replica group, scored through its worker's Score.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import grpc

from services.common.dtypes import lookup_dtype
from services.common.errors import InvalidArgument, Unavailable
from services.common.numerics import DEFAULT_NUMERICS, LAYOUT_INVARIANT, PER_LAYOUT
from services.common.proto import common_pb2, worker_pb2, worker_pb2_grpc
from services.common.proto_convert import DTYPE_FROM_PB
from services.common.registry import NotFound as RegistryNotFound
from services.common.registry import QualityGateResult, ShardRegistry, registry_group_id
from services.common.transport_security import open_channel
from services.quality.comparison import Comparison, GateVerdict, ScoreResult, bootstrap_delta_interval, compare, gate
from services.quality.golden_set import DEFAULT_CHUNK_TOKENS, DEFAULT_CHUNKS, GoldenSet

if TYPE_CHECKING:
    from services.worker.runtime import RankSpec

PLAN_KEYS = ("tp", "pp", "dtype", "checkpoint", "model", "lm_head", "numerics")
DEFAULT_THRESHOLD_PCT = 0.5
DEFAULT_MIN_TOP1 = 0.97  # for plans of one dtype family
DEFAULT_COLLECTIVE_TIMEOUT_S = 30.0  # a chunk's prefill on a busy CPU is slow


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


def plan_spec(model_dir: str | None, text: str, *,
              collective_timeout_s: float = DEFAULT_COLLECTIVE_TIMEOUT_S) -> RankSpec:
    """The rank spec of plan ``text`` of the model in ``model_dir``; a bad plan raises here."""
    # deferred: local plans need torch; the fleet controller gates live groups and never imports it
    from services.worker.runtime import RankSpec

    plan = parse_plan(text)
    try:
        tp, pp = int(plan.get("tp", 1)), int(plan.get("pp", 1))
    except ValueError:
        raise InvalidArgument(f"plan {text!r}: tp and pp are whole numbers") from None
    checkpoint = plan.get("checkpoint")
    lm_head = plan.get("lm_head")
    if lm_head not in (None, "quantized", "dense"):
        raise InvalidArgument(f"plan {text!r}: lm_head is 'quantized' or 'dense', got {lm_head!r}")
    return RankSpec(None if checkpoint else plan.get("model", model_dir), tp_degree=tp, pp_degree=pp,
                    dtype=plan.get("dtype"), checkpoint=checkpoint, collective_timeout_s=collective_timeout_s,
                    replica_group_id=f"golden-{text}",
                    quantize_lm_head=None if lm_head is None else lm_head == "quantized",
                    numerics=plan.get("numerics", DEFAULT_NUMERICS))


def dtype_family(dtype: str) -> str:
    """A dtype's numeric format: ``16-bit float`` for bfloat16 and float16, else the dtype's own
    name. Two plans of one family differ only in layout (TP/PP, summation order), so their top-1
    choices must agree almost everywhere; across families the perplexity delta is the measure."""
    name = lookup_dtype(dtype)
    return "16-bit float" if name in ("bfloat16", "float16") else str(name)


@dataclass(frozen=True)
class PlanScores:
    """One side's scores of the golden set: a local plan's, or a live replica group's."""

    plan: str  # as written: a plan spec, or ``worker=HOST:PORT``
    model_name: str
    dtype: str
    results: list[ScoreResult]
    seconds: float
    # which weights (runtime.weights_fingerprint: "" where not known) and how the plan orders
    # its sums, a local plan's or a live group's (its worker says). Two layout-invariant plans of
    # the same weights and dtype must give the same bits: the gate then asks for equality (run_gate)
    source: str = ""
    numerics: str = DEFAULT_NUMERICS
    lm_head: bool = True


def golden_set_for(model_dir: str | None, spec: RankSpec | None, *, chunks: int = DEFAULT_CHUNKS,
                   chunk_tokens: int = DEFAULT_CHUNK_TOKENS) -> GoldenSet:
    # deferred: the tokenizer's loader sits with the model code, which imports torch (see plan_spec)
    from services.worker.engine.bootstrap import load_tokenizer
    from services.worker.runtime import stage_tokenizer_dir

    tokenizer = load_tokenizer(model_dir or (stage_tokenizer_dir(spec) if spec is not None else None))
    if tokenizer is None:
        raise InvalidArgument("the golden set needs the model's tokenizer.json (give --model DIR)")
    try:
        return GoldenSet.build(lambda text: tokenizer.encode(text, add_special_tokens=False).ids,
                               chunks=chunks, chunk_tokens=chunk_tokens)
    except ValueError as exc:
        raise InvalidArgument(str(exc)) from None


def check_comparable(specs: Sequence[RankSpec], golden: GoldenSet) -> None:
    """Local plans must share a vocabulary and fit the chunks (a live group's worker checks its own)."""
    if not specs:
        return
    vocab = specs[0].plan.config.vocab_size
    for spec in specs:
        if spec.plan.config.vocab_size != vocab:
            raise InvalidArgument(f"the plans' vocabularies differ ({vocab} and {spec.plan.config.vocab_size}): "
                                  f"they cannot be scored on the same tokens")
        if golden.chunk_tokens > spec.plan.config.max_position_embeddings:
            raise InvalidArgument(f"chunks of {golden.chunk_tokens} tokens exceed the model's "
                                  f"max_position_embeddings {spec.plan.config.max_position_embeddings}")


def score_plan(spec: RankSpec, text: str, golden: GoldenSet) -> PlanScores:
    # deferred: running ranks locally needs torch (see plan_spec)
    from services.worker.launch import run_replica_group
    from services.worker.runtime import weights_fingerprint
    from services.worker.scoring import score_chunks_rank

    start = time.perf_counter()
    results = run_replica_group(spec.plan.world_size, score_chunks_rank, spec, [list(c) for c in golden.chunks],
                                failure_grace_s=spec.collective_timeout_s + 3.0)
    return PlanScores(text, spec.plan.config.name, spec.plan.dtype, results, time.perf_counter() - start,
                      source=weights_fingerprint(spec), numerics=spec.plan.numerics,
                      lm_head=spec.plan.quantize_lm_head)


def is_live(text: str) -> bool:
    """Whether ``text`` names a serving replica group (``worker=HOST:PORT`` or ``group=ID``)."""
    key, sep, value = text.strip().partition("=")
    return bool(sep) and key.strip() in ("worker", "group") and "," not in value


def live_address(text: str, registry_url: str | None = None) -> str:
    """The WorkerService address of ``worker=HOST:PORT``, or of ``group=ID`` as the registry has it
    (the group's endpoint; a dead group or one without an endpoint is refused)."""
    key, _, value = text.strip().partition("=")
    if key.strip() == "worker":
        return value.strip()
    with ShardRegistry(registry_url) as registry:
        try:
            group = registry.get_group(registry_group_id(value.strip()))
        except RegistryNotFound:
            raise InvalidArgument(f"{text}: no such replica group in the registry") from None
    if group.status == "dead" or not group.endpoint:
        raise InvalidArgument(f"{text}: the group is {group.status} with endpoint {group.endpoint!r}: nothing to score")
    return group.endpoint


def score_live_group(text: str, golden: GoldenSet, *, registry_url: str | None = None,
                     timeout_s: float = 600.0) -> PlanScores:
    """The golden set scored by a serving replica group through its worker's ``Score`` (one
    prefill between its engine steps per chunk; its requests go on). TLS and the internal token
    as the ``SHARDLINE_*`` environment says."""
    address = live_address(text, registry_url)
    start = time.perf_counter()
    results = []
    with open_channel(address) as channel:
        stub = worker_pb2_grpc.WorkerServiceStub(channel)
        try:
            stats = stub.Stats(worker_pb2.StatsRequest(weights_identity=True), timeout=60)
            for chunk in golden.chunks:
                r = stub.Score(worker_pb2.ScoreRequest(token_ids=common_pb2.TokenIds(ids=list(chunk)), top_logprobs=1),
                               timeout=timeout_s)
                results.append(ScoreResult.from_logprobs(r.n_tokens, list(r.logprobs),
                                                         [t.alternatives[0].token_id for t in r.top_logprobs]))
        except grpc.RpcError as exc:
            raise Unavailable(f"worker {address}: {exc.code().name}: {exc.details()}") from None
    return PlanScores(text.strip(), stats.model_name, DTYPE_FROM_PB.get(stats.layout.dtype, ""),
                      results, time.perf_counter() - start, source=stats.model_fingerprint,
                      numerics=stats.numerics or PER_LAYOUT,  # a worker that does not say: before the mode
                      lm_head=stats.quantize_lm_head)


@dataclass(frozen=True)
class GateResult:
    reference: PlanScores
    candidate: PlanScores
    golden: GoldenSet
    comparison: Comparison
    verdict: GateVerdict


def run_gate(reference: PlanScores, candidate: PlanScores, golden: GoldenSet, *,
             threshold_pct: float = DEFAULT_THRESHOLD_PCT, min_top1_agreement: float | None = None,
             bootstrap_samples: int = 1000) -> GateResult:
    """The verdict on ``candidate`` against ``reference``. ``min_top1_agreement`` None: the
    default floor for two plans of one dtype family, no floor across families (a quantized
    candidate answers to its perplexity delta)."""
    comparison = compare(reference.results, candidate.results)
    interval = bootstrap_delta_interval(reference.results, candidate.results, samples=bootstrap_samples)
    if min_top1_agreement is None and dtype_family(reference.dtype) == dtype_family(candidate.dtype):
        min_top1_agreement = DEFAULT_MIN_TOP1
    verdict = gate(comparison, interval, threshold_pct=threshold_pct, min_top1_agreement=min_top1_agreement)
    if layout_only(reference, candidate):  # the same bits are owed: one differing logprob fails
        mismatch = first_difference(reference.results, candidate.results)
        reasons = () if mismatch is None else (
            f"layout-invariant plans of the same weights must be equal, but {mismatch}",)
        verdict = replace(verdict, passed=not reasons, reasons=reasons, exact=True)
    return GateResult(reference, candidate, golden, comparison, verdict)


def layout_only(a: PlanScores, b: PlanScores) -> bool:
    """Two plans (local or live) in the layout-invariant numerics that differ in nothing but
    their layout: the same weights (a known fingerprint), dtype and lm_head."""
    return (a.numerics == b.numerics == LAYOUT_INVARIANT and bool(a.source) and a.source == b.source
            and a.dtype == b.dtype and a.lm_head == b.lm_head)


def first_difference(reference: list[ScoreResult], candidate: list[ScoreResult]) -> str | None:
    """Where two plans' logprobs first differ in their bits (``chunk i position j: a vs b``), or None."""
    for i, (r, c) in enumerate(zip(reference, candidate, strict=True)):
        for j, (a, b) in enumerate(zip(r.logprobs, c.logprobs, strict=True)):
            if a != b:
                return f"chunk {i} position {j}: {a!r} vs {b!r}"
    return None


def record_gate(result: GateResult, registry_url: str | None, *, migrate_schema: bool = True) -> QualityGateResult:
    """Record a verdict with its figures in the registry (``quality_gate_results``)."""
    c, v = result.comparison, result.verdict
    with ShardRegistry(registry_url, migrate_schema=migrate_schema) as registry:
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
