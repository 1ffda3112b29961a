"""Quantized weights against the bfloat16 plan: memory, decode speed, quality, replica density.

    python -m bench.quant [--quick] [--rounds 3] [--chunks 32] [--engine-only] [--name NAME]
    (also: shardline bench quant)

SmolLM2-135M, TP1, one run: for bfloat16, int8 and fp8 (activations bfloat16) the weight bytes a
rank holds (from its loaded tensors, scales included), TPOT at batch 1 and tokens/s at 16
streams through the engine (its KV cache, scheduler and sampler; the dtypes alternate round by
round and each ratio is the median of its per-round ratios), the batch-1 decode step against the
memory roofline of that dtype's bytes, and on the golden set the perplexity delta against the
bfloat16 plan and against float32, with greedy top-1 agreement, for round-to-nearest weights, for
an lm_head left dense, and for `shardline quantize`'s GPTQ-calibrated copies (calibrated here,
on the standard library's docstrings, never the golden set). Replica density: how many groups of
each dtype fit one fixed memory budget, each with the same KV cache.

Writes bench/results/quant.json and quant.md.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

import torch
from tokenizers import Tokenizer

from bench.common import machine, smollm2_dir, write_results
from bench.engine import make_prompts, read_bandwidth, run_engine, spec_for
from services.loader.layout import RankLayout
from services.modeling.quant import scheme_for
from services.quality.comparison import compare
from services.quality.gate import golden_set_for, plan_spec, score_plan
from services.worker.calibration import quantize_model_dir
from services.worker.engine.bootstrap import build_engine, start_rank

DTYPES = ("bfloat16", "int8", "fp8")
DENSITY_BUDGET_BYTES = 4 << 30  # one fixed memory budget the replica groups share
DENSITY_KV_BYTES = 128 << 20  # the KV cache each group keeps, the same at every dtype (bfloat16 KV)


def held_bytes(model: torch.nn.Module) -> dict[str, int]:
    """Bytes of the loaded tensors, each once (a tied table counts once): all of them, the
    scales among them, and what a decode step reads (all but an untied embedding table)."""
    total = scales = embedding = 0
    for name, param in model.named_parameters():  # named_parameters yields a shared tensor once
        nbytes = param.numel() * param.element_size()
        total += nbytes
        scales += nbytes if name.endswith("_scale") else 0
        embedding += nbytes if "embed_tokens" in name else 0
    tied = getattr(model, "lm_head", None) is not None and model.lm_head.weight is getattr(
        model.model.embed_tokens, "weight", None)
    return {"weight_bytes": total, "scale_bytes": scales, "read_bytes": total if tied else total - embedding}


def held_bytes_of(spec) -> int:
    """The weight bytes a rank of ``spec`` holds, from its model built on ``meta``."""
    return RankLayout.for_rank(spec.plan, 0).nbytes


def bench_engines(model_dir, tokenizer, *, rounds: int, max_tokens: int, streams: int) -> dict:
    engines, held = {}, {}
    for dtype in DTYPES:
        spec = spec_for(model_dir, dtype)
        runner, layout = start_rank(spec, 0)
        engines[dtype] = build_engine(spec, runner, layout)
        held[dtype] = held_bytes(runner.rt.model)
    prompts = make_prompts(tokenizer, streams)
    for engine in engines.values():
        run_engine(engine, prompts[:2], 4)  # warm-up
    per_round = []
    for _ in range(rounds):
        row = {}
        for dtype, engine in engines.items():
            bs1 = run_engine(engine, prompts[:1], max_tokens)
            batch = run_engine(engine, prompts, max_tokens)
            row[dtype] = {"tpot_s": bs1["tpot_s"], "step_s": bs1["decode_step_s"], "tok_s": batch["tok_per_s"]}
        per_round.append(row)
    for engine in engines.values():
        engine.shutdown()
    bandwidth = read_bandwidth(torch.bfloat16)
    out = {"rounds": per_round, "read_bandwidth_bytes_per_s": bandwidth, "streams": streams,
           "new_tokens": max_tokens}
    for dtype in DTYPES:
        med = {k: statistics.median(r[dtype][k] for r in per_round) for k in ("tpot_s", "step_s", "tok_s")}
        roofline_s = held[dtype]["read_bytes"] / bandwidth

        def vs_bf16(key: str, dtype: str = dtype) -> float:
            return statistics.median(r[dtype][key] / r["bfloat16"][key] for r in per_round)

        out[dtype] = {**held[dtype], **med, "roofline_s": roofline_s, "step_vs_roofline": med["step_s"] / roofline_s,
                      "weight_bytes_vs_bf16": held[dtype]["weight_bytes"] / held["bfloat16"]["weight_bytes"],
                      "tpot_vs_bf16": vs_bf16("tpot_s"), "tok_s_vs_bf16": vs_bf16("tok_s"),
                      "replica_groups_in_budget": DENSITY_BUDGET_BYTES // (held[dtype]["weight_bytes"]
                                                                           + DENSITY_KV_BYTES)}
    return out


# the lm_head kept dense: the other choice for a quantized plan, scored for the comparison
DENSE_HEAD = tuple(f"{dtype},lm_head=dense" for dtype in DTYPES[1:])
CALIBRATED = tuple(f"{dtype},gptq" for dtype in DTYPES[1:])  # `shardline quantize` copies, served as that dtype
PLANS = (*DTYPES, *DENSE_HEAD, *CALIBRATED)


def calibrated_plans(model_dir: Path, workdir: Path) -> dict[str, str]:
    """The plan text of each calibrated row: its `shardline quantize` copy, made here."""
    plans = {}
    for name in CALIBRATED:
        dtype = name.split(",")[0]
        report = quantize_model_dir(model_dir, workdir / name.replace(",", "-"), scheme_for(dtype))
        print(f"calibrated {dtype}: {report.tensors} tensors in {report.seconds:.0f} s", flush=True)
        plans[name] = f"dtype={dtype},model={report.out_dir}"
    return plans


def bench_quality(model_dir, *, chunks: int, chunk_tokens: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="bench-quant-") as workdir:
        texts = {name: f"dtype={name}" for name in ("float32", *DTYPES, *DENSE_HEAD)}
        texts.update(calibrated_plans(Path(model_dir), Path(workdir)))
        specs = {name: plan_spec(str(model_dir), text) for name, text in texts.items()}
        golden = golden_set_for(str(model_dir), specs["float32"], chunks=chunks, chunk_tokens=chunk_tokens)
        scores = {name: score_plan(spec, texts[name], golden) for name, spec in specs.items()}
        weight_bytes = {name: held_bytes_of(specs[name]) for name in PLANS}
    out: dict = {"chunks": chunks, "chunk_tokens": chunk_tokens, "scored_tokens": golden.scored_tokens,
                 "text_fingerprint": golden.text_fingerprint}
    for dtype in PLANS:
        vs_bf16 = compare(scores["bfloat16"].results, scores[dtype].results)
        vs_fp32 = compare(scores["float32"].results, scores[dtype].results)
        out[dtype] = {"perplexity": vs_bf16.candidate_perplexity,
                      "ppl_delta_vs_bf16_pct": vs_bf16.perplexity_delta_pct,
                      "ppl_delta_vs_fp32_pct": vs_fp32.perplexity_delta_pct,
                      "top1_vs_bf16": vs_bf16.top1_agreement, "top1_vs_fp32": vs_fp32.top1_agreement,
                      "mean_abs_dlogprob_vs_bf16": vs_bf16.mean_abs_logprob_delta,
                      "weight_bytes": weight_bytes[dtype]}
    out["float32_perplexity"] = compare(scores["float32"].results, scores["float32"].results).reference_perplexity
    return out


def engine_markdown(payload: dict) -> str:
    """The title and the engine table: bytes, TPOT, tok/s at 16 streams, density per dtype."""
    e = payload["engine"]
    lines = ["# Quantized weights vs the bfloat16 plan (SmolLM2-135M, TP1)", "",
             f"Machine: {payload['machine']}. Command: `{payload['command']}`. Engine figures: medians of "
             f"{len(e['rounds'])} rounds in which the dtypes alternate; ratios are per-round ratios' medians.", "",
             "| dtype | weight bytes/rank | vs bf16 | TPOT bs1 (ms) | TPOT vs bf16 | tok/s @16 | vs bf16 "
             "| step vs roofline | groups in 4 GiB |", "|---|---|---|---|---|---|---|---|---|"]
    for dtype in DTYPES:
        d = e[dtype]
        lines.append(f"| {dtype} | {d['weight_bytes']:,} | {d['weight_bytes_vs_bf16']:.3f} | {d['tpot_s'] * 1e3:.2f} "
                     f"| {d['tpot_vs_bf16']:.3f} | {d['tok_s']:.0f} | {d['tok_s_vs_bf16']:.3f} "
                     f"| {d['step_vs_roofline']:.2f} | {d['replica_groups_in_budget']} |")
    return "\n".join(lines) + "\n"


def markdown(payload: dict) -> str:
    e, q = payload["engine"], payload["quality"]
    lines = engine_markdown(payload).rstrip("\n").split("\n")
    lines += ["", f"Golden set: {q['chunks']} chunks x {q['chunk_tokens']} tokens = {q['scored_tokens']} scored "
                  f"positions (text {q['text_fingerprint']}); float32 perplexity {q['float32_perplexity']:.4f}.", "",
              "| plan | weight bytes/rank | perplexity | Δ vs bf16 | Δ vs fp32 | top-1 vs bf16 | top-1 vs fp32 "
              "| mean abs Δlogprob vs bf16 |",
              "|---|---|---|---|---|---|---|---|"]
    for dtype in PLANS:
        d = q[dtype]
        lines.append(f"| {dtype} | {d['weight_bytes']:,} | {d['perplexity']:.4f} | "
                     f"{d['ppl_delta_vs_bf16_pct']:+.3f} % | "
                     f"{d['ppl_delta_vs_fp32_pct']:+.3f} % | {d['top1_vs_bf16']:.4f} | {d['top1_vs_fp32']:.4f} | "
                     f"{d['mean_abs_dlogprob_vs_bf16']:.4f} |")
    lines += ["", "Against the bars (perplexity delta vs the bfloat16 plan: int8 ≤ 0.5 %, fp8 ≤ 1.0 %; the design's "
                  "gate 0.5 %; weight bytes ≤ 0.55 × bf16; TPOT int8 < 0.8 ×, fp8 < 1.0 ×; 16 streams ≥ 1.0 ×):", ""]
    for dtype, bar in (("int8", 0.5), ("fp8", 1.0), ("int8,gptq", 0.5), ("fp8,gptq", 1.0)):
        d, q_ = e[dtype.split(",")[0]], q[dtype]
        checks = [("bytes", d["weight_bytes_vs_bf16"] <= 0.55),
                  ("TPOT", d["tpot_vs_bf16"] < (0.8 if dtype == "int8" else 1.0)),
                  ("16 streams", d["tok_s_vs_bf16"] >= 1.0),
                  (f"perplexity ≤ {bar:g} %", q_["ppl_delta_vs_bf16_pct"] <= bar),
                  ("design gate 0.5 %", q_["ppl_delta_vs_bf16_pct"] <= 0.5)]
        lines.append(f"- {dtype}: " + ", ".join(f"{name} {'pass' if ok else 'FAIL'}" for name, ok in checks))
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.quant", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one round, 8 chunks of the golden set")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--chunks", type=int, default=32, help="golden-set chunks of 512 tokens (default 32)")
    parser.add_argument("--engine-only", action="store_true",
                        help="bytes and speed only, no golden set: writes bench/results/quant-engine.*")
    parser.add_argument("--name", default=None,
                        help="results: bench/results/NAME.{json,md} (default quant, or quant-engine with "
                             "--engine-only; name another machine's run apart)")
    args = parser.parse_args(argv)
    model_dir = smollm2_dir()
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    rounds, chunks = (1, 8) if args.quick else (args.rounds, args.chunks)
    if args.engine_only:
        payload = {"machine": machine(), "command": "python -m bench.quant " + " ".join(argv or sys.argv[1:]),
                   "engine": bench_engines(model_dir, tokenizer, rounds=rounds, max_tokens=32, streams=16)}
        text = engine_markdown(payload)
        json_path, md_path = write_results(args.name or "quant-engine", payload, text)
        print(text)
        print(f"wrote {json_path} and {md_path}")
        return 0
    payload = {"machine": machine(), "command": "python -m bench.quant " + " ".join(argv or sys.argv[1:]),
               "engine": bench_engines(model_dir, tokenizer, rounds=rounds, max_tokens=32, streams=16),
               "quality": bench_quality(model_dir, chunks=chunks, chunk_tokens=512)}
    for dtype in ("int8", "fp8"):
        payload[f"ppl_delta_{dtype}_gptq_vs_bf16_pct"] = payload["quality"][f"{dtype},gptq"]["ppl_delta_vs_bf16_pct"]
        payload[f"tpot_{dtype}_vs_bf16"] = payload["engine"][dtype]["tpot_vs_bf16"]
        payload[f"tok_s_{dtype}_vs_bf16"] = payload["engine"][dtype]["tok_s_vs_bf16"]
        payload[f"ppl_delta_{dtype}_vs_bf16_pct"] = payload["quality"][dtype]["ppl_delta_vs_bf16_pct"]
    json_path, md_path = write_results(args.name or "quant", payload, markdown(payload))
    print(markdown(payload))
    print(f"wrote {json_path} and {md_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
