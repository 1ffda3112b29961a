"""What structured outputs cost a decode step: TPOT with a JSON-schema guide against the same
requests without one, at c=1 and c=16, SmolLM2-135M bfloat16 in one engine (greedy, ignore_eos,
64 tokens each; the schema asks for a long array of integers, so every token is guided).

The engine runs in this process, as a worker's driver runs it: the guided rows' llguidance masks
are computed on the driver each step and applied where the group samples. Rounds alternate the
two modes; the figures are medians. vLLM's ratio on the same schema is not measured here yet.
"""

from __future__ import annotations

import argparse
import json
import statistics

from bench.common import machine, smollm2_dir, write_results
from bench.engine import run_engine, spec_for
from services.worker.engine.bootstrap import build_engine, start_rank

SCHEMA = {"type": "object", "properties": {"xs": {"type": "array", "items": {"type": "integer"}, "minItems": 200}},
          "required": ["xs"]}
MAX_TOKENS = 64


def tpot_ms(engine, n: int, guided: bool) -> float:
    """Median TPOT of ``n`` concurrent requests (bench.engine's run_engine)."""
    prompts = [[1, 504, 3543, 314, 260, 1345 + i] for i in range(n)]
    guide = ("json_schema", json.dumps(SCHEMA)) if guided else None
    return run_engine(engine, prompts, MAX_TOKENS, guide=guide)["tpot_s"] * 1e3


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    spec = spec_for(smollm2_dir(), "bfloat16")
    runner, layout = start_rank(spec, 0)
    engine = build_engine(spec, runner, layout)
    tpot_ms(engine, 2, True), tpot_ms(engine, 2, False)  # warm-up: kernels, the llguidance tokenizer
    rows = []
    for c in (1, 16):
        free, guided = [], []
        for _ in range(args.rounds):
            free.append(tpot_ms(engine, c, False))
            guided.append(tpot_ms(engine, c, True))
        rows.append({"concurrency": c, "free_tpot_ms": statistics.median(free),
                     "guided_tpot_ms": statistics.median(guided),
                     "ratio": statistics.median(guided) / statistics.median(free)})
    info = machine()
    lines = ["# Structured outputs: TPOT with a JSON-schema guide / without", "",
             f"`python -m bench.guided --rounds {args.rounds}`; {info['cpu_model']}, {info['torch_threads']} threads; "
             f"SmolLM2-135M bfloat16, one engine in process, greedy, {MAX_TOKENS} tokens, medians of "
             f"{args.rounds} alternating rounds.", "",
             "| c | TPOT without ms | TPOT guided ms | guided / without |", "|---|---|---|---|"]
    lines += [f"| {r['concurrency']} | {r['free_tpot_ms']:.2f} | {r['guided_tpot_ms']:.2f} | {r['ratio']:.3f} |"
              for r in rows]
    write_results("guided", {"machine": info, "schema": SCHEMA, "rows": rows}, "\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
