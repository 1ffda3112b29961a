"""What vLLM's metrics cost the engine: the same batch with and without the worker's listener.

    python -m bench.metrics_overhead [--rounds 5] [--requests 16] [--max-tokens 64]

One SmolLM2-135M bfloat16 engine (TP1), built once. Each round runs the batch twice, without and
with ``EngineMetrics`` (the step listener a worker serving ``/metrics`` attaches, on a registry of
its own here), in alternating order; the figure is the median over rounds of the per-round ratio
of wall times, so a burst of other work on the host lands on both. Writes
``bench/results/metrics-overhead.{json,md}``.
"""

from __future__ import annotations

import argparse
import statistics
import time

from prometheus_client import CollectorRegistry
from tokenizers import Tokenizer

from bench.common import machine, publish_results, smollm2_dir
from bench.engine import make_prompts, run_engine, spec_for
from services.worker.engine.bootstrap import build_engine, start_rank
from services.worker.engine_metrics import attach_engine_metrics


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.metrics_overhead", description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args(argv)
    model_dir = smollm2_dir()
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    prompts = make_prompts(tokenizer, args.requests)
    spec = spec_for(model_dir, "bfloat16")
    runner, layout = start_rank(spec, 0)
    engine = build_engine(spec, runner, layout)
    listener = attach_engine_metrics(engine, "smollm2", registry=CollectorRegistry())
    engine.step_listeners.remove(listener)
    run_engine(engine, prompts[:2], 4)  # warm-up

    def timed(with_metrics: bool) -> float:
        if with_metrics:
            engine.step_listeners.append(listener)
        try:
            t0 = time.perf_counter()
            run_engine(engine, prompts, args.max_tokens)
            return time.perf_counter() - t0
        finally:
            if with_metrics:
                engine.step_listeners.remove(listener)

    rounds = []
    for i in range(args.rounds):
        order = (False, True) if i % 2 == 0 else (True, False)
        times = {flag: timed(flag) for flag in order}
        rounds.append({"without_s": times[False], "with_s": times[True]})
        print(f"round {i}: without {times[False]:.3f} s, with {times[True]:.3f} s", flush=True)
    ratio = statistics.median(r["with_s"] / r["without_s"] for r in rounds)
    observed = listener.metrics.e2e.labels("smollm2", "0")._sum.get()  # noqa: SLF001 - proof it recorded
    payload = {"machine": machine(), "model": "SmolLM2-135M", "dtype": "bfloat16", "requests": args.requests,
               "max_tokens": args.max_tokens, "rounds": rounds, "ratio_with_over_without": ratio,
               "recorded_e2e_seconds": observed}
    markdown = "\n".join([
        "# vLLM metrics: their cost to the engine", "",
        f"SmolLM2-135M bfloat16, TP1, {args.requests} requests x {args.max_tokens} tokens at once, "
        f"{args.rounds} rounds alternating the order; {payload['machine']['cpu_model']}.", "",
        "| round | without (s) | with (s) |", "|---|---|---|",
        *(f"| {i} | {r['without_s']:.3f} | {r['with_s']:.3f} |" for i, r in enumerate(rounds)), "",
        f"Median of the per-round ratios, with / without: **{ratio:.3f}**. "
        f"(`python -m bench.metrics_overhead --rounds {args.rounds}`)", ""])
    return publish_results("metrics-overhead", payload, markdown)


if __name__ == "__main__":
    raise SystemExit(main())
